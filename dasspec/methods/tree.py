"""Static draft trees given as *choices* (Medusa / Token Recycling notation) and their layer-by-layer fill.

A choice is a path of child ranks from the root: ``[0, 1]`` = the root's rank-0 successor, then that token's
rank-1 successor.  ``tree_from_choices`` orders the nodes breadth-first (by depth, then lexicographically), so
every depth is a contiguous index range and every parent precedes its children; ``fill_tree`` then writes the
whole tree with one gather per depth from a successor table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


def _brief(value) -> str:
    """A choice as a message quotes it: never a whole request's worth."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class StaticTree:
    choices: tuple[tuple[int, ...], ...]   # BFS-ordered, root excluded
    parents: tuple[int, ...]               # [T], -1 for the root
    ranks: tuple[int, ...]                 # [T], successor rank of each node under its parent (root: 0)
    levels: tuple[tuple[int, int], ...]    # [lo, hi) node range of depth 1, 2, ...

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def max_rank(self) -> int:
        return max(self.ranks[1:], default=-1)

    def truncated(self, size: int) -> "StaticTree":
        """The first ``size`` nodes (a BFS prefix is still a tree)."""
        size = max(1, min(size, self.size))
        levels = tuple((lo, min(hi, size)) for lo, hi in self.levels if lo < size)
        return StaticTree(self.choices[: size - 1], self.parents[:size], self.ranks[:size], levels)

    def nodes_within_depth(self, depth: int) -> int:
        """Number of nodes of depth <= ``depth`` (root included)."""
        return self.levels[depth - 1][1] if 1 <= depth <= len(self.levels) else (1 if depth < 1 else self.size)


def tree_from_choices(choices: Sequence[Sequence[int]]) -> StaticTree:
    """Validate choices (non-negative ranks, no duplicates, every prefix present) and lay the tree out BFS."""
    paths = []
    for c in choices:
        if isinstance(c, (str, bytes)) or not isinstance(c, Sequence) or not c:
            raise ValueError(f"a tree choice must be a non-empty list of child ranks, got {_brief(c)}")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in c):
            raise ValueError(f"tree choice {_brief(list(c))} has a rank that is not an integer >= 0")
        paths.append(tuple(c))
    if len(set(paths)) != len(paths):
        raise ValueError("tree choices contain a duplicate path")
    present = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in present:
            raise ValueError(f"tree choice {_brief(list(p))} has no parent {_brief(list(p[:-1]))} in the tree")
    paths.sort(key=lambda p: (len(p), p))
    index = {(): 0}
    parents, ranks, levels = [-1], [0], []
    for i, p in enumerate(paths, 1):
        index[p] = i
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
        if len(p) > len(levels):
            levels.append([i, i + 1])
        else:
            levels[-1][1] = i + 1
    return StaticTree(tuple(paths), tuple(parents), tuple(ranks), tuple((lo, hi) for lo, hi in levels))


class TreeFiller:
    """Device-side index tensors of a StaticTree, for ``fill``: tok[node] = table[tok[parent(node)], rank(node)]
    one depth at a time (Token Recycling's "static-tree BFS", paper Algorithm 1)."""

    def __init__(self, tree: StaticTree, device: torch.device | str | None):
        self.tree = tree
        self.parent = torch.tensor(tree.parents, dtype=torch.long, device=device)
        self.rank = torch.tensor(tree.ranks, dtype=torch.long, device=device)

    def fill(self, tokens: Tensor, table: Tensor) -> None:
        """``tokens[0]`` holds the root; writes tokens[1:T] from the successor ``table`` [V, k]."""
        for lo, hi in self.tree.levels:
            tokens[lo:hi] = table[tokens[self.parent[lo:hi]], self.rank[lo:hi]]
