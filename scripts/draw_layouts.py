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
BEGIN, END = "<!-- BEGIN GENERATED (scripts/draw_layouts.py) -->", "<!-- END GENERATED -->"


def _doc_char(d: int) -> str:
    return "." if d == 0 else "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[(d - 1) % 26]


def draw(doc_ids: torch.Tensor, cp: int, layout: str) -> str:
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
    for b in range(B):
        docs = "".join(_doc_char(int(d)) for d in doc_ids[b])
        ranks = "".join(str(int(o)) for o in owner[b * S : (b + 1) * S])
        lines.append(f"row {b}  doc  {docs}")
        lines.append(f"       rank {ranks}")
    flat = doc_ids.reshape(-1)
    for r, s in enumerate(shards):
        local = "".join(_doc_char(int(d)) for d in flat[s.token_index])
        cost = int((s.position_ids + 1).sum())
        lines.append(f"rank {r} local stream {local}   causal cost {cost}")
    return "\n".join(lines)


def markdown() -> str:
    out = [BEGIN, "", f"Example map (letters = documents, `.` = padding), B={EXAMPLE.shape[0]}, "
           f"S={EXAMPLE.shape[1]}, cp={CP}:", ""]
    for layout in ("contiguous", "zigzag", "balanced"):
        out += [f"### `{layout}`", "", "```", draw(EXAMPLE, CP, layout), "```", ""]
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
