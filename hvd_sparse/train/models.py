"""Models for the training entry point."""
import torch
from torch import nn
from torch.nn import functional as F


class _Block(nn.Module):
    """A basic residual block (two 3x3 convolutions, batch norm, identity or 1x1 shortcut)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class SmallResNet(nn.Module):
    """A ResNet-style CNN for 28x28 grey images, small enough to train on two CPU cores."""

    def __init__(self, classes=10, width=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = _Block(width, width, 1)
        self.layer2 = _Block(width, 2 * width, 2)
        self.layer3 = _Block(2 * width, 4 * width, 2)
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class SimpleCNN(nn.Module):
    """Two convolutions and two dense layers (about 420k parameters)."""

    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
                                        nn.Linear(128, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class WideMLP(nn.Module):
    """784-3000-3000-10 (about 11.4M parameters): a communication-heavy model whose step is
    cheap to compute, for measuring what the network costs."""

    def __init__(self, classes=10, width=3000):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


class DeepMLP(nn.Module):
    """784-256, then 100 blocks of Linear(256, 256), LayerNorm and ReLU, then 10 (about 6.8M
    parameters in 404 tensors, three in four of them small): a model whose step is dominated
    by the number of tensors, for measuring the per-tensor cost of the exchange."""

    def __init__(self, classes=10, width=256, depth=100):
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())
                  for _ in range(depth)]
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), *blocks,
                                 nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


class CharLSTM(nn.Module):
    """A character-level LSTM language model."""

    def __init__(self, vocab, embed=64, hidden=256, layers=1):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        out, _ = self.lstm(self.embed(x))
        return self.head(out)


class CharGRU(nn.Module):
    """A two-layer character-level GRU language model (a recurrent cell and depth the
    convergence study did not tune on: the held-out check's model)."""

    def __init__(self, vocab, embed=48, hidden=192, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        out, _ = self.gru(self.embed(x))
        return self.head(out)


class CharTCN(nn.Module):
    """A causal dilated convolutional character model (a WaveNet/ByteNet-style residual
    stack, receptive field 63 characters): a sequence model neither recurrent nor attentive,
    for held-out checks of defaults chosen on the others."""

    def __init__(self, vocab, embed=64, channels=192, kernel=3, dilations=(1, 2, 4, 8, 16)):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.inp = nn.Conv1d(embed, channels, 1)
        self.convs = nn.ModuleList(nn.Conv1d(channels, channels, kernel, dilation=d)
                                   for d in dilations)
        self.pads = [(kernel - 1) * d for d in dilations]  # left only: nothing from the future
        self.head = nn.Linear(channels, vocab)

    def forward(self, x):
        h = self.inp(self.embed(x).transpose(1, 2))
        for conv, pad in zip(self.convs, self.pads):
            h = h + F.relu(conv(F.pad(h, (pad, 0))))
        return self.head(h.transpose(1, 2))


class CharTransformer(nn.Module):
    """A small causal character-level Transformer (pre-norm, learned positions)."""

    def __init__(self, vocab, d_model=128, heads=4, layers=3, ff=512, max_len=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(max_len, d_model))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=x.device), diagonal=1)
        h = self.blocks(self.embed(x) + self.pos[:t], mask=mask, is_causal=True)
        return self.head(self.norm(h))


MODELS = {"resnet": SmallResNet, "cnn": SimpleCNN, "mlp11m": WideMLP, "mlpdeep": DeepMLP}
CHAR_MODELS = {"lstm": CharLSTM, "gru": CharGRU, "tcn": CharTCN, "transformer": CharTransformer}
