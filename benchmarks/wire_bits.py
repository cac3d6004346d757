"""Wire benchmark: bits on the wire per selected entry, per codec, against the entropy bound.

    .venv/bin/python benchmarks/wire_bits.py

Encodes real payloads (``hvd_sparse.wire.encode``, headers and padding included) for positions
drawn at each density from a vector of N entries, and reports bits per selected entry, split into
position bits and value bits, next to the entropy bound of the positions (H(p)/p bits) plus the
value bits. Results: benchmarks/results/wire_bits.json and .png.
"""
from __future__ import annotations

import torch

from common import RESULTS, machine, save
from hvd_sparse import golomb, wire

CODECS = {
    "int32+fp32": dict(index_coding="plain", value_dtype=torch.float32),
    "int32+fp16": dict(index_coding="plain", value_dtype=torch.float16),
    "int32+bf16": dict(index_coding="plain", value_dtype=torch.bfloat16),
    "golomb+fp32": dict(index_coding="golomb", value_dtype=torch.float32),
    "golomb+fp16": dict(index_coding="golomb", value_dtype=torch.float16),
    "sbc (golomb+1 mean)": dict(index_coding="golomb", value_dtype=torch.float32, constant=True),
}


def main(n=10_000_000, densities=(0.01, 0.001, 0.0001)):
    rows = []
    g = torch.Generator().manual_seed(0)
    for p in densities:
        idx = torch.nonzero(torch.rand(n, generator=g) < p).squeeze(1)
        vals = torch.randn(idx.numel(), generator=g)
        bound = golomb.entropy_bits_per_position(p)
        for name, c in CODECS.items():
            buf = wire.encode(idx, vals.to(c["value_dtype"]), index_dtype=torch.int32, tag=0,
                              numel=n, index_coding=c["index_coding"],
                              constant=c.get("constant", False))
            value_bits = 0.0 if c.get("constant") else \
                torch.empty(0, dtype=c["value_dtype"]).element_size() * 8
            total = buf.numel() * 8 / idx.numel()
            rows.append({"codec": name, "density": p, "n": n, "selected": idx.numel(),
                         "bytes": buf.numel(), "bits_per_entry": total,
                         "position_bits": total - value_bits,
                         "entropy_position_bits": bound,
                         "bound_bits_per_entry": bound + value_bits,
                         "ratio_vs_dense_fp32": n * 32 / (buf.numel() * 8)})
            print(f"p={p:<7g} {name:<20} {total:6.2f} bits/entry (positions {total - value_bits:6.2f},"
                  f" entropy bound {bound:6.2f})  compression vs dense fp32 "
                  f"{rows[-1]['ratio_vs_dense_fp32']:8.1f}x", flush=True)
    save("wire_bits", {"machine": machine(), "rows": rows})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(CODECS)
    width = 0.8 / len(densities)
    for j, p in enumerate(densities):
        sel = [r for r in rows if r["density"] == p]
        ax.bar([i + j * width for i in range(len(names))], [r["position_bits"] for r in sel],
               width, label=f"positions, p={p:g}")
        ax.scatter([i + j * width for i in range(len(names))],
                   [r["entropy_position_bits"] for r in sel], marker="_", s=200, color="k")
    ax.set_xticks([i + width for i in range(len(names))], names, rotation=20, fontsize=8)
    ax.set_ylabel("position bits per selected entry (black: entropy bound)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "wire_bits.png", dpi=120)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
