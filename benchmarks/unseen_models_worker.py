"""One rank of benchmarks/unseen_models.py: a model and a task no default was chosen on.

Run by the driver under ``mpirun -np P``; prints ``RESULT {json}`` on rank 0. Every data set is
synthetic (fixed seeds, nothing downloaded) and every model is outside ``hvd_sparse.train``:
a small Vision Transformer (stripes by orientation, AdamW, warm-up and cosine), a BatchNorm and
Dropout CNN (noisy shifted templates, SGD with Nesterov momentum and weight decay, StepLR), a
GPT-style decoder with a tied head (sequence reversal, AdamW, gradient clipping by Horovod's
pattern), an MLP regression (Adagrad or RMSprop) and a GRU classifier (SGD with momentum).
``--mode dense`` is Horovod's own optimizer; ``--mode sparse`` is hvd_sparse with only
``density`` and the JSON ``--options`` set. Batches are per rank and step, the same in both.
"""
import argparse
import hashlib
import json
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--task", required=True)
ap.add_argument("--mode", required=True, choices=["dense", "sparse"])
ap.add_argument("--density", type=float, default=0.01)
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--opt", default=None, help="mlp: adagrad (default) or rmsprop")
ap.add_argument("--options", default="{}", help="JSON keywords for hvd_sparse's optimizer")
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()

torch.set_num_threads(1)
import horovod.torch as hvdt  # noqa: E402

if args.mode == "dense":
    hvd = hvdt
else:
    import hvd_sparse as hvd
hvd.init()
rank = hvd.rank()

# ---------------------------------------------------------------- data
def stripes(gen, n, noise=2.5):
    """16x16 images, 4 classes = stripe orientation (0,45,90,135 deg), random freq/phase + noise."""
    y = torch.randint(0, 4, (n,), generator=gen)
    ang = y.float() * math.pi / 4 + (torch.rand(n, generator=gen) - 0.5) * 0.3
    freq = 0.6 + 0.6 * torch.rand(n, generator=gen)
    ph = 2 * math.pi * torch.rand(n, generator=gen)
    ii, jj = torch.meshgrid(torch.arange(16.), torch.arange(16.), indexing="ij")
    proj = (ii[None] * torch.cos(ang)[:, None, None] + jj[None] * torch.sin(ang)[:, None, None])
    img = torch.sin(proj * freq[:, None, None] + ph[:, None, None])
    img = img + noise * torch.randn(n, 16, 16, generator=gen)
    return img[:, None], y

_tmpl_gen = torch.Generator().manual_seed(12345)
TEMPL = F.avg_pool2d(torch.randn(10, 3, 20, 20, generator=_tmpl_gen), 5, 1, 2)[:, :, :20, :20]
TEMPL = TEMPL / TEMPL.flatten(1).std(1)[:, None, None, None]
def templates(gen, n, noise=4.0):
    """3x16x16 images: one of 10 smooth random templates, randomly cropped (shift) + heavy noise."""
    y = torch.randint(0, 10, (n,), generator=gen)
    dx = torch.randint(0, 5, (n,), generator=gen); dy = torch.randint(0, 5, (n,), generator=gen)
    img = torch.stack([TEMPL[y[i], :, dy[i]:dy[i] + 16, dx[i]:dx[i] + 16] for i in range(n)])
    return img + noise * torch.randn(n, 3, 16, 16, generator=gen), y

V, L = 16, 8  # reversal task: tokens 2..15, SEP=1
def reversal(gen, n):
    x = torch.randint(2, V, (n, L), generator=gen)
    seq = torch.cat([x, torch.ones(n, 1, dtype=torch.long), x.flip(1)], 1)  # len 17
    inp, tgt = seq[:, :-1], seq[:, 1:].clone()
    tgt[:, :L] = -100  # loss only on the reversed part
    return inp, tgt

_teacher_gen = torch.Generator().manual_seed(777)
TW1 = torch.randn(32, 64, generator=_teacher_gen) / math.sqrt(32)
TW2 = torch.randn(64, 1, generator=_teacher_gen) / math.sqrt(64)
def regression(gen, n):
    x = torch.randn(n, 32, generator=gen)
    y = torch.tanh(x @ TW1) @ TW2 + 0.1 * torch.sin(3 * x[:, :1]) + 0.05 * torch.randn(n, 1, generator=gen)
    return x, y

def majority(gen, n, T=16):
    """Sequence of symbols 0..4 (one-hot, 8-dim with noise); class = symbol that appears most among 0..3."""
    base = torch.randint(0, 5, (n, T), generator=gen)
    y = torch.randint(0, 4, (n,), generator=gen)
    extra = torch.rand(n, T, generator=gen) < 0.15
    base = torch.where(extra, y[:, None].expand(n, T), base)
    cnt = torch.stack([(base == c).sum(1) for c in range(4)], 1).float()
    y = (cnt + 0.01 * torch.arange(4.)).argmax(1)
    x = F.one_hot(base, 8).float() + 0.3 * torch.randn(n, T, 8, generator=gen)
    return x, y

# ---------------------------------------------------------------- models
class ViT(nn.Module):
    def __init__(s, dim=64, depth=3, heads=4, ncls=4, patch=4):
        super().__init__()
        s.patch = nn.Conv2d(1, dim, patch, patch)
        s.cls = nn.Parameter(torch.zeros(1, 1, dim)); s.pos = nn.Parameter(0.02 * torch.randn(1, 17, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        s.enc = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        s.norm = nn.LayerNorm(dim); s.head = nn.Linear(dim, ncls)
    def forward(s, x):
        t = s.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([s.cls.expand(len(t), -1, -1), t], 1) + s.pos
        return s.head(s.norm(s.enc(t)[:, 0]))

class CNN(nn.Module):
    def __init__(s):
        super().__init__()
        def blk(i, o): return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())
        s.f = nn.Sequential(blk(3, 32), blk(32, 32), nn.MaxPool2d(2), blk(32, 64), blk(64, 64), nn.MaxPool2d(2),
                            blk(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(128, 10))
    def forward(s, x): return s.f(x)

class GPT(nn.Module):
    def __init__(s, dim=96, depth=2, heads=4, T=16):
        super().__init__()
        s.tok = nn.Embedding(V, dim); s.pos = nn.Embedding(T, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        s.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        s.ln = nn.LayerNorm(dim); s.head = nn.Linear(dim, V, bias=False); s.head.weight = s.tok.weight
        s.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))
    def forward(s, x):
        h = s.tok(x) + s.pos(torch.arange(x.shape[1]))
        return s.head(s.ln(s.blocks(h, mask=s.mask, is_causal=True)))

class RNN(nn.Module):
    def __init__(s):
        super().__init__(); s.gru = nn.GRU(8, 96, batch_first=True); s.head = nn.Linear(96, 4)
    def forward(s, x): return s.head(s.gru(x)[0][:, -1])

# ---------------------------------------------------------------- task setup
torch.manual_seed(args.seed)
T = args.task
B = 32
if T == "vit":
    model = ViT(); data = stripes; lossf = F.cross_entropy
    base = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    warm = args.steps // 10
    sched_fn = lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (args.steps - warm)))
elif T == "cnn":
    model = CNN(); data = templates; lossf = F.cross_entropy
    if args.opt == "sgdplain":
        base = torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=5e-4)
    else:
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
elif T == "gpt":
    model = GPT(); data = reversal
    lossf = lambda out, y: F.cross_entropy(out.reshape(-1, V), y.reshape(-1), ignore_index=-100)
    base = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
elif T == "mlp":
    model = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    data = regression; lossf = F.mse_loss
    if (args.opt or "adagrad") == "adagrad":
        base = torch.optim.Adagrad(model.parameters(), lr=0.02)
    else:
        base = torch.optim.RMSprop(model.parameters(), lr=3e-4)
elif T == "gru":
    model = RNN(); data = majority; lossf = F.cross_entropy
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
else:
    raise SystemExit("unknown task")
nparams = sum(p.numel() for p in model.parameters())

if args.mode == "dense":
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
else:
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   density=args.density, **json.loads(args.options))
if T == "vit":
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sched_fn)
elif T == "cnn":
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, args.steps // 3), gamma=0.3)
else:
    sched = None
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)

# eval set (same on all ranks)
eg = torch.Generator().manual_seed(999)
ex, ey = data(eg, 1024)

torch.manual_seed(1000 + rank + 7919 * args.seed)  # dropout RNG per rank, same in dense and sparse
losses = []; nan_step = None
t0 = time.time()
for step in range(args.steps):
    g = torch.Generator().manual_seed(step * 1000 + rank + 10**7 * args.seed)
    x, y = data(g, B)
    model.train()
    opt.zero_grad()
    out = model(x); loss = lossf(out, y)
    loss.backward()
    if T == "gpt":
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()
    if sched: sched.step()
    lv = loss.item(); losses.append(lv)
    if not math.isfinite(lv) and nan_step is None: nan_step = step
wall = time.time() - t0

model.eval()
with torch.no_grad():
    eo = model(ex); el = lossf(eo, ey).item()
    if T in ("vit", "cnn", "gru"):
        acc = (eo.argmax(-1) == ey).float().mean().item()
    elif T == "gpt":
        m = ey != -100; acc = (eo.argmax(-1)[m] == ey[m]).float().mean().item()
    else:
        acc = None

h = hashlib.sha256()
for n, p in model.named_parameters(): h.update(p.detach().contiguous().numpy().tobytes())
hb = hashlib.sha256()
for n, b in model.named_buffers(): hb.update(b.detach().contiguous().numpy().tobytes())
hashes = hvdt.allgather_object((h.hexdigest(), hb.hexdigest()))
tail = torch.tensor([float(np.mean(losses[-20:]))])
tail = hvdt.allreduce(tail, op=hvdt.Average).item()
el_all = hvdt.allgather_object(el)

res = dict(task=T, mode=args.mode, density=args.density, steps=args.steps,
           options=json.loads(args.options), seed=args.seed, optimizer=type(base).__name__,
           nparams=nparams, eval_loss=el, eval_loss_all=el_all, eval_acc=acc, train_tail=tail,
           wall_s=wall, nan_step=nan_step, params_identical=len({x[0] for x in hashes}) == 1,
           buffers_identical=len({x[1] for x in hashes}) == 1,
           dense_bytes=4 * nparams * args.steps)  # Horovod's allreduce payload per rank, fp32
if args.mode == "dense":
    res["bytes_sent"] = res["dense_bytes"]
else:
    st = opt.communication_stats()
    res["bytes_sent"] = st["totals"]["bytes_sent"]
    res["calibration_bytes"] = st["totals"].get("calibration_bytes", 0)
    res["exchange"] = st["exchange"]
if rank == 0:
    print("RESULT " + json.dumps(res), flush=True)
