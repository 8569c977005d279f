"""Draw which tokens each CP rank holds, per layout, for a small example map (text pictures for docs/layouts.md).

    python scripts/draw_layouts.py            # prints the markdown block
    python scripts/draw_layouts.py --write    # rewrites the generated part of docs/layouts.md
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params  # noqa: E402

EXAMPLE = torch.tensor(
    [
        [1] * 8 + [2] * 4 + [3] * 16 + [0] * 4,
        [1] * 20 + [2] * 8 + [3] * 4,
    ]
)
CP = 2
# A larger map for the balanced planner, which cuts nothing shorter than balanced.MIN_CHUNK tokens: one character
# per 16 tokens (a character shows the block's document, and its rank, or * when ranks share the block).
BIG = torch.tensor(
    [
        [1] * 640 + [2] * 96 + [3] * 160 + [4] * 80 + [0] * 48,
        [1] * 112 + [2] * 64 + [3] * 208 + [4] * 480 + [5] * 96 + [0] * 64,
    ]
)
BIG_CP, BIG_SCALE = 4, 16
BEGIN, END = "<!-- BEGIN GENERATED (scripts/draw_layouts.py) -->", "<!-- END GENERATED -->"


def _doc_char(d: int) -> str:
    return "." if d == 0 else "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[(d - 1) % 26]


def draw(doc_ids: torch.Tensor, cp: int, layout: str, scale: int = 1) -> str:
    params = packed_seq_params_from_doc_ids(doc_ids)
    try:
        shards = [shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout=layout) for r in range(cp)]
    except ValueError as err:
        return f"(not valid for this map: {err})"
    B, S = doc_ids.shape
    owner = torch.empty(B * S, dtype=torch.int64)
    for r, s in enumerate(shards):
        owner[s.token_index] = r
    lines = []
    flat = doc_ids.reshape(-1)

    def blocks(values: torch.Tensor, mixed: str) -> str:
        out = []
        for i in range(0, values.numel(), scale):
            block = values[i : i + scale]
            out.append(str(int(block[0])) if bool((block == block[0]).all()) else mixed)
        return "".join(out)

    for b in range(B):
        row = flat[b * S : (b + 1) * S]
        docs = "".join(_doc_char(int(row[i])) for i in range(0, S, scale))
        lines.append(f"row {b}  doc  {docs}")
        lines.append(f"       rank {blocks(owner[b * S : (b + 1) * S], '*')}")
    costs = []
    for r, s in enumerate(shards):
        local = "".join(_doc_char(int(d)) for d in flat[s.token_index][::scale])
        cost = int((s.position_ids + 1).sum())
        costs.append(cost)
        runs = s.cu_seqlens.numel() - 1
        lines.append(f"rank {r} local stream {local}   causal cost {cost:>6}, {runs} runs")
    lines.append(f"busiest / mean = {max(costs) / (sum(costs) / len(costs)):.3f}")
    return "\n".join(lines)


def markdown() -> str:
    out = [BEGIN, "", f"Example map (letters = documents, `.` = padding), B={EXAMPLE.shape[0]}, "
           f"S={EXAMPLE.shape[1]}, cp={CP}:", ""]
    for layout in ("contiguous", "zigzag", "balanced", "local"):
        out += [f"### `{layout}`", "", "```", draw(EXAMPLE, CP, layout), "```", ""]
    out += [
        f"### A larger map: B={BIG.shape[0]}, S={BIG.shape[1]}, cp={BIG_CP}, one character per {BIG_SCALE} tokens",
        "",
        "The balanced planner keeps short documents whole and cuts nothing shorter than "
        "`cp_packing.layouts.balanced.MIN_CHUNK` tokens, so on the tiny map above it has nothing to cut. Here zigzag needs "
        "no padding either (every run is a multiple of 2*cp), for comparison. `local` cuts segments only at its "
        "2cp - 2 interval bounds (docs/balance.md).",
        "",
    ]
    for layout in ("contiguous", "zigzag", "balanced", "local"):
        out += [f"`{layout}`:", "", "```", draw(BIG, BIG_CP, layout, BIG_SCALE), "```", ""]
    out.append(END)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the generated block of docs/layouts.md")
    args = parser.parse_args()
    block = markdown()
    if not args.write:
        print(block)
        return
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "layouts.md")
    text = open(path).read()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    open(path, "w").write(text[:start] + block + text[end:])


if __name__ == "__main__":
    main()
