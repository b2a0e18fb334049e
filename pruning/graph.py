"""The channel dependency graph: which indices of which tensors must be pruned together.

Every prunable index is an *item*: index ``i`` along ``axis`` of a parameter or buffer (a
*coordinate*), or one element of a parameter used directly in an op. Coupled items are joined in a
union-find; each resulting set is an *atom*, the unit that is kept or removed as a whole (one
channel of a conv and its BatchNorm and consumers, or one attention head across q/k/v/output).
Atoms that share a coordinate form a *group*: the set importance is compared in and a per-group
ratio applies to.

The graph is built by :func:`pruning.trace.trace_dependencies` from one forward pass.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

#: what a coordinate does to the channels through it
OUT = "out"  # creates channels (conv/linear output rows, embedding dims, attention heads)
IN = "in"  # consumes channels (conv/linear input columns)
NORM = "norm"  # follows channels one to one (norm affine params and statistics, biases)
ELEMENT = "element"  # one item per element of a parameter used directly in an op (pos_embed)
VIRTUAL = "virtual"  # a coupling with no tensor to slice (grouped-conv inputs)


@dataclass
class Coord:
    """A range of items: index ``i`` of ``axis`` of tensor ``key`` is item ``base + i``."""

    key: str
    axis: int | None
    size: int
    base: int
    roles: set[str]
    module: str
    shape: tuple[int, ...] = ()

    @property
    def items(self) -> range:
        return range(self.base, self.base + self.size)


@dataclass
class Atom:
    """Items removed together. ``prunable`` is False when pinned (model output, input, ignore)."""

    index: int
    items: np.ndarray
    prunable: bool
    group: int = -1


@dataclass
class Group:
    """Atoms that share a coordinate: the set a ratio and importance ranking apply to."""

    index: int
    atoms: list[int]
    coords: list[int]
    modules: list[str] = field(default_factory=list)

    def width(self, graph: DependencyGraph) -> int:
        """Indices per atom in the group's widest producing coordinate (1 for plain channels)."""
        best = 1
        for ci in self.coords:
            c = graph.coords[ci]
            if OUT in c.roles and c.axis is not None:
                per = c.size // max(1, len(self.atoms))
                best = max(best, per)
        return best


class DependencyGraph:
    """Items, their couplings and pins; :meth:`finalize` derives atoms and groups."""

    def __init__(self) -> None:
        self.coords: list[Coord] = []
        self._coord_index: dict[tuple[str, int | None], int] = {}
        self._parent: list[int] = []
        self._item_coord: list[int] = []
        self._pins: set[int] = set()
        self._pin_reasons: dict[int, str] = {}
        self.atoms: list[Atom] = []
        self.groups: list[Group] = []
        self._item_atom: np.ndarray = np.zeros(0, dtype=np.int64)
        #: output shapes of the traced forward (to check the pruned model against)
        self.output_shapes: list[tuple[int, ...]] = []
        #: per MAC-producing call: (kind, macs, payload) used by the cost model
        self.mac_records: list[tuple[str, int, tuple[object, ...]]] = []
        #: int attributes a forward reshapes or splits with, that may be a channel width: per call,
        #: the candidate (module, attribute) pairs holding that value and the item ids of that dim
        #: (positions x indices); surgery sets candidate ``width_choice[i]`` (default 0) to the
        #: kept count when every index of the dim is one unit
        self.width_attrs: list[tuple[list[tuple[str, str]], torch.Tensor]] = []
        self.width_choice: dict[int, int] = {}
        #: how grouped convs prune: "groups" (whole groups) or "width" (every group narrower)
        self.grouped_conv = "groups"
        #: grouped convs pruned by width: module -> group count (kept, written to the plan)
        self.group_width_convs: dict[str, int] = {}

    # ---- building -----------------------------------------------------------------------------
    def coord(
        self,
        key: str,
        axis: int | None,
        size: int,
        role: str,
        module: str,
        shape: tuple[int, ...] = (),
    ) -> Coord:
        """The coordinate for ``(key, axis)``, created on first use; ``role`` is added to it."""
        idx = self._coord_index.get((key, axis))
        if idx is not None:
            c = self.coords[idx]
            c.roles.add(role)
            return c
        c = Coord(key, axis, size, len(self._parent), {role}, module, shape)
        self._coord_index[(key, axis)] = len(self.coords)
        self.coords.append(c)
        start = len(self._parent)
        self._parent.extend(range(start, start + size))
        self._item_coord.extend([len(self.coords) - 1] * size)
        return c

    def find_coord(self, key: str, axis: int | None) -> Coord | None:
        idx = self._coord_index.get((key, axis))
        return None if idx is None else self.coords[idx]

    def item_labels(self, c: Coord) -> torch.Tensor:
        """Item ids of a coordinate as a 1-D int64 tensor."""
        return torch.arange(c.base, c.base + c.size, dtype=torch.int64)

    def find(self, x: int) -> int:
        p = self._parent
        while p[x] != x:
            p[x] = p[p[x]]
            x = p[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            if ra < rb:
                self._parent[rb] = ra
            else:
                self._parent[ra] = rb

    def union_tensors(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Join items pairwise where both label tensors (same shape) hold an item."""
        a, b = torch.broadcast_tensors(a, b)
        mask = (a >= 0) & (b >= 0) & (a != b)
        if not bool(mask.any()):
            return
        n = self.num_items + 1
        codes = torch.unique(a[mask] * n + b[mask])  # 1-D unique is far faster than unique(dim=0)
        for code in codes.tolist():
            self.union(code // n, code % n)

    def union_all(self, labels: torch.Tensor) -> None:
        """Join every item in ``labels`` into one atom."""
        ids = torch.unique(labels[labels >= 0]).tolist()
        for x in ids[1:]:
            self.union(ids[0], x)

    def pin(self, labels: torch.Tensor | list[int], reason: str) -> None:
        """Mark items (and so their atoms) unprunable."""
        ids = torch.unique(labels[labels >= 0]).tolist() if isinstance(labels, torch.Tensor) else labels
        for x in ids:
            self._pins.add(int(x))
            self._pin_reasons.setdefault(int(x), reason)

    def roots(self, labels: torch.Tensor) -> torch.Tensor:
        """``labels`` with each item replaced by its current set representative (-1 kept)."""
        flat = labels.reshape(-1)
        ids = torch.unique(flat[flat >= 0])
        if ids.numel() == 0:
            return labels.clone()
        lut = {int(i): self.find(int(i)) for i in ids.tolist()}
        out = flat.clone()
        keys = torch.tensor(list(lut.keys()), dtype=torch.int64)
        vals = torch.tensor(list(lut.values()), dtype=torch.int64)
        pos = torch.searchsorted(keys, flat.clamp(min=0))
        pos = pos.clamp(max=keys.numel() - 1)
        hit = (flat >= 0) & (keys[pos] == flat)
        out[hit] = vals[pos[hit]]
        return out.view(labels.shape)

    @property
    def num_items(self) -> int:
        return len(self._parent)

    # ---- derived structure ------------------------------------------------------------------
    def finalize(self, *, ignore_modules: frozenset[str] | set[str] = frozenset()) -> None:
        """Compute atoms (sets of items), their prunability, and groups."""
        n = self.num_items
        roots = np.fromiter((self.find(i) for i in range(n)), dtype=np.int64, count=n)
        uniq, inverse = np.unique(roots, return_inverse=True)
        self._item_atom = inverse.astype(np.int64)
        members: list[list[int]] = [[] for _ in range(len(uniq))]
        for item, atom in enumerate(self._item_atom.tolist()):
            members[atom].append(item)
        has_out = np.zeros(len(uniq), dtype=bool)
        pinned = np.zeros(len(uniq), dtype=bool)
        for c in self.coords:
            atoms_here = self._item_atom[c.base : c.base + c.size]
            if OUT in c.roles:
                has_out[atoms_here] = True
                if c.module in ignore_modules:
                    pinned[atoms_here] = True
        for item in self._pins:
            pinned[self._item_atom[item]] = True
        self.atoms = [
            Atom(i, np.asarray(members[i], dtype=np.int64), bool(has_out[i] and not pinned[i]))
            for i in range(len(uniq))
        ]
        # groups: atoms sharing a coordinate (a small union-find over atoms)
        parent = list(range(len(self.atoms)))

        def gfind(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for c in self.coords:
            atoms_here = np.unique(self._item_atom[c.base : c.base + c.size]).tolist()
            for a in atoms_here[1:]:
                ra, rb = gfind(atoms_here[0]), gfind(a)
                if ra != rb:
                    parent[rb] = ra
        by_root: dict[int, list[int]] = defaultdict(list)
        for a in range(len(self.atoms)):
            by_root[gfind(a)].append(a)
        coords_of: dict[int, set[int]] = defaultdict(set)
        for ci, c in enumerate(self.coords):
            for a in np.unique(self._item_atom[c.base : c.base + c.size]).tolist():
                coords_of[gfind(a)].add(ci)
        self.groups = []
        for root, atoms in by_root.items():
            gi = len(self.groups)
            coords = sorted(coords_of[root])
            mods = sorted({self.coords[ci].module for ci in coords if OUT in self.coords[ci].roles})
            self.groups.append(Group(gi, atoms, coords, mods))
            for a in atoms:
                self.atoms[a].group = gi

    def item_atom(self, item: int) -> int:
        """The atom an item ended in (after :meth:`finalize`)."""
        return int(self._item_atom[item])

    def coord_atoms(self, c: Coord) -> np.ndarray:
        """Atom index of every index of coordinate ``c``."""
        return self._item_atom[c.base : c.base + c.size]

    def label_atoms(self, labels: torch.Tensor) -> torch.Tensor:
        """Atom index per element of a label tensor (-1 where unlabeled)."""
        lut = torch.from_numpy(self._item_atom)
        out = torch.full_like(labels, -1)
        mask = labels >= 0
        out[mask] = lut[labels[mask]]
        return out

    def prunable_groups(self) -> list[Group]:
        """Groups with at least two atoms of which at least one is prunable."""
        return [g for g in self.groups if sum(self.atoms[a].prunable for a in g.atoms) >= 1 and len(g.atoms) >= 2]

    def describe(self) -> list[dict[str, object]]:
        """One row per prunable group: its modules, atom count and how many atoms may go."""
        rows = []
        for g in self.prunable_groups():
            rows.append(
                {
                    "group": g.index,
                    "modules": ", ".join(g.modules[:4]) + (", ..." if len(g.modules) > 4 else ""),
                    "units": len(g.atoms),
                    "prunable": sum(self.atoms[a].prunable for a in g.atoms),
                    "width": g.width(self),
                }
            )
        return rows
