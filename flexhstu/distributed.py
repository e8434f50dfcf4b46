"""Training on several processes: the process group, item tables sharded across ranks, memory pre-checks.

``flexhstu train`` under ``torchrun`` replicates the dense model with DistributedDataParallel. The item table
(``num_items + 1`` rows of ``dim``), which is what outgrows one GPU, can be split across the ranks with
``--shard-embeddings``:

- ``none``: every rank holds the whole table (DDP all-reduces its gradient).
- ``rowwise``: a DTensor sharded by rows (``Shard(0)``, ``torch.chunk`` sizes); each rank stores, updates and
  checkpoints only its rows. A lookup sends the ids every rank asks for to every rank (an all-gather of ids),
  each rank reads the rows it owns, and a reduce-scatter returns each rank its own rows; the backward is the
  reverse, so gradients arrive at the owner. No rank ever holds more than its rows of the table, its gradient
  or AdamW's moments, so tables larger than one GPU train.
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on the table: the table, its gradient and AdamW's
  moments are sharded between steps, and FSDP all-gathers the whole table for each lookup. It saves the
  optimizer state's memory, but one GPU must hold the table and its gradient during a step.

In every mode a rank's gradient is the mean over the ranks (as DDP's), and the table's initial values depend
only on the seed (``init_rows``), so the modes train the same parameters up to float rounding.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._errors import as_int, bad_value

SHARDING = ("none", "rowwise", "fsdp")
INIT_BLOCK_ROWS = 4096  # the table is initialised in blocks of rows, each from its own seeded generator


def setup() -> tuple[int, int, bool]:
    """``(rank, world size, created)``: joins the process group that torchrun describes (``WORLD_SIZE > 1``)
    unless one exists; ``created`` says whether this call made it (and so should destroy it)."""
    created = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        created = True
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), created
    return 0, 1, created


def local_world_size() -> int:
    """Processes on this host (torchrun's ``LOCAL_WORLD_SIZE``), which share its memory."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def shard_range(num_rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of ``rank`` when ``num_rows`` are split as ``torch.chunk`` does (DTensor's and
    FSDP2's ``Shard(0)``): ``ceil(num_rows / world)`` each, the last ranks may get fewer."""
    per = -(-num_rows // world)
    start = min(rank * per, num_rows)
    return start, min(start + per, num_rows)


def _block_seed(seed: int, block: int) -> int:
    # torch's CPU generator keeps 32 bits of a seed: consecutive blocks of one run get distinct seeds
    return (seed * 0x9E3779B1 + block) % 2**32


def init_rows(out: torch.Tensor, start: int, seed: int, std: float) -> torch.Tensor:
    """Fill ``out`` (rows ``start .. start + len(out)`` of a table) with ``N(0, std^2)`` values that depend only on
    ``seed`` and the row: block ``b`` of ``INIT_BLOCK_ROWS`` rows comes from a generator seeded by ``(seed, b)``,
    so any split of the rows across ranks gives the same table. Blocks are drawn on the CPU in parallel."""
    n, dim = out.shape
    if n == 0:
        return out
    first, last = start // INIT_BLOCK_ROWS, (start + n - 1) // INIT_BLOCK_ROWS

    def fill(block: int) -> None:
        b0 = block * INIT_BLOCK_ROWS
        g = torch.Generator().manual_seed(_block_seed(seed, block))
        values = torch.empty(INIT_BLOCK_ROWS, dim).normal_(0.0, std, generator=g)
        lo, hi = max(b0, start), min(b0 + INIT_BLOCK_ROWS, start + n)
        out[lo - start : hi - start].copy_(values[lo - b0 : hi - b0])

    workers = max(1, min(last - first + 1, (os.cpu_count() or 1) // local_world_size()))
    with torch.no_grad():
        if workers == 1:
            for b in range(first, last + 1):
                fill(b)
        else:
            with ThreadPoolExecutor(workers) as pool:  # the generators and copies release the GIL
                list(pool.map(fill, range(first, last + 1)))
    return out


class ItemTable(nn.Module):
    """The item embedding table, ``num_rows x dim`` float32, rows initialised by ``init_rows(seed)`` with
    ``std = dim ** -0.5``. ``forward(ids)`` returns the rows of ``ids`` (any shape), which may differ per rank.

    ``mode``: ``"whole"`` (a plain parameter), ``"rowwise"`` (a DTensor sharded by rows over ``mesh``, looked
    up as the module docstring says) or ``"fsdp"`` (made whole, then ``fully_shard`` over ``mesh``; build it
    with ``item_table``). Row 0 is padding: it never gets a gradient from a lookup."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        *,
        seed: int = 0,
        mode: str = "whole",
        mesh=None,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.num_rows, self.dim = as_int("num_rows", num_rows, 1), as_int("dim", dim, 1)
        if mode not in ("whole", "rowwise", "fsdp"):
            raise bad_value("mode", "'whole', 'rowwise' or 'fsdp'", repr(mode))
        if mode != "whole" and mesh is None:
            raise bad_value("mesh", f"a DeviceMesh for mode {mode!r}", None)
        self.mode, self.mesh = mode, mesh
        self.world = mesh.size() if mesh is not None else 1
        last_start, last_end = shard_range(num_rows, self.world, self.world - 1)
        if last_end <= last_start:
            raise bad_value("num_rows", f"enough rows to give each of {self.world} ranks some", num_rows)
        start, end = self.row_range() if mode == "rowwise" else (0, num_rows)
        local = init_rows(torch.empty(end - start, dim, device=device), start, seed, dim**-0.5)
        if mode == "rowwise":
            from torch.distributed.tensor import DTensor, Shard

            local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(num_rows, dim), stride=(dim, 1))
        self.weight = nn.Parameter(local)

    @property
    def sharded(self) -> bool:
        return self.mode != "whole"

    @property
    def group(self):
        return self.mesh.get_group() if self.mesh is not None else None

    def row_range(self) -> tuple[int, int]:
        """The rows this rank stores (all of them for ``whole``)."""
        if not self.sharded:
            return 0, self.num_rows
        return shard_range(self.num_rows, self.world, self.mesh.get_local_rank())

    def local_weight(self) -> torch.Tensor:
        """This rank's rows, ``row_range()``, as a plain tensor (outside a forward, for fsdp too)."""
        w = self.weight
        if hasattr(w, "to_local"):
            return w.to_local()
        start, end = self.row_range()
        return w[start:end]  # fsdp between an unshard and its reshard holds the whole table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.mode != "rowwise":  # fsdp: the hooks of fully_shard made self.weight whole for this call
            return F.embedding(ids, self.weight, padding_idx=0)
        return self._rowwise(ids)

    def _rowwise(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Shard

        group, world = self.group, self.world
        flat = ids.reshape(-1)
        count = torch.tensor([flat.numel()], device=flat.device)
        counts = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=group)
        width = int(torch.cat(counts).max())  # every rank sends this many ids (padded with 0)
        padded = flat.new_zeros(width)
        padded[: flat.numel()] = flat
        every = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(every, padded, group=group)
        wanted = torch.cat(every)  # (world * width,): rank r's ids at [r * width, r * width + count_r)
        local = self.weight.to_local()
        start, end = self.row_range()
        mine = (wanted >= start) & (wanted < end)
        # padding_idx: global row 0 (rank 0's local row 0) gets no gradient, as nn.Embedding's; rows of other ranks
        # are zeroed with where, so not even a non-finite gradient reaches the row they were read from
        rows = F.embedding(torch.where(mine, wanted - start, 0), local, padding_idx=0 if start == 0 else None)
        rows = torch.where(mine[:, None], rows, 0.0)
        # the ranks' partial rows summed, and rank r's block of `width` rows returned to it: a reduce-scatter,
        # whose backward (an all-gather of the row gradients) brings each gradient to the rank that owns the row
        out = DTensor.from_local(rows, self.mesh, [Partial()], run_check=False)
        out = out.redistribute(self.mesh, [Shard(0)]).to_local()[: flat.numel()]
        if out.requires_grad and world > 1:
            out.register_hook(lambda g: g / world)  # the owner sums every rank's gradient; DDP's mean is 1/world
        return out.reshape(*ids.shape, self.dim)


def table_mesh(device: torch.device):
    """A one-dimensional DeviceMesh over all ranks with its own process group, so the table's collectives never
    interleave with DDP's."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.new_group(), device.type)


def item_table(num_rows: int, dim: int, *, seed: int, sharding: str, world: int, device: torch.device) -> ItemTable:
    """The table of ``--shard-embeddings sharding`` on ``world`` ranks (one rank: always whole)."""
    if sharding not in SHARDING:
        raise bad_value("--shard-embeddings", " or ".join(SHARDING), repr(sharding))
    if world == 1 or sharding == "none":
        return ItemTable(num_rows, dim, seed=seed, device=device)
    mesh = table_mesh(device)
    if sharding == "rowwise":
        return ItemTable(num_rows, dim, seed=seed, mode="rowwise", mesh=mesh, device=device)
    from torch.distributed.fsdp import fully_shard

    table = ItemTable(num_rows, dim, seed=seed, mode="fsdp", mesh=mesh, device=device)
    # keeps this rank's chunk of rows and frees the rest; the table is the root FSDP module, which FSDP would
    # otherwise leave whole after a forward
    fully_shard(table, mesh=mesh, reshard_after_forward=True)
    return table


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s item table (``model.encoder.items``) is split across ranks."""
    table = getattr(getattr(model, "encoder", None), "items", None)
    return isinstance(table, ItemTable) and table.sharded


# --- memory --------------------------------------------------------------------------------------------------

STATE_COPIES = 4  # the table, its gradient and AdamW's two moments, all float32


def table_bytes(num_rows: int, dim: int, sharding: str, world: int) -> int:
    """Bytes one rank needs for the item table with its gradient and AdamW's two moments (float32).

    none: all four whole. rowwise: four copies of ``ceil(num_rows / world)`` rows. fsdp: four copies of that
    chunk between steps, plus the whole table and its whole gradient that a step all-gathers."""
    whole = num_rows * dim * 4
    chunk = -(-num_rows // world) * dim * 4
    if sharding == "none" or world == 1:
        return STATE_COPIES * whole
    if sharding == "rowwise":
        return STATE_COPIES * chunk
    return STATE_COPIES * chunk + 2 * whole


def free_bytes(device: torch.device) -> int:
    """Memory this rank can still use: free memory of its GPU, or this host's available memory over the
    ranks on the host."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available // local_world_size()


def check_table_memory(num_rows: int, dim: int, sharding: str, world: int, free: int, where: str) -> None:
    """``ValueError`` (one line) if the table's state does not fit ``free`` bytes per rank, with the fix."""
    need = table_bytes(num_rows, dim, sharding, world)
    if need <= free:
        return
    ranks = math.ceil(STATE_COPIES * num_rows * dim * 4 / max(free, 1))  # rowwise ranks of this size that fit
    fix = ""
    if sharding != "rowwise" or world < ranks:
        fix = f"; shard it with --shard-embeddings rowwise over {max(ranks, 2)} or more ranks with this much memory"
    raise bad_value(
        f"--shard-embeddings {sharding}",
        f"an item table that fits: {num_rows:,} x {dim} float32 with its gradient and AdamW's two "
        f"moments needs {need / 1e9:.1f} GB per rank on {world} rank{'s' * (world > 1)}",
        f"{free / 1e9:.1f} GB free on {where}{fix}",
    )


# --- optimisation and evaluation -----------------------------------------------------------------------------


def clip_grad_norm_(params, max_norm: float, group=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose parameters are partly sharded DTensors: the norm
    of the whole gradient (shards summed over ``group``), every gradient scaled by
    ``min(1, max_norm / (norm + 1e-6))``."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = (grads[0].to_local() if hasattr(grads[0], "to_local") else grads[0]).device
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:  # per-tensor norms in the gradient's dtype (no float64 copy of a large table), as torch's
        local = g.to_local() if hasattr(g, "to_local") else g
        square = torch.linalg.vector_norm(local).double().square()
        if hasattr(g, "placements") and any(p.is_shard() for p in g.placements):
            sharded += square
        else:
            replicated += square
    if group is not None:
        dist.all_reduce(sharded, group=group)
    norm = (replicated + sharded).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        (g.to_local() if hasattr(g, "to_local") else g).mul_(coef.to(g.dtype))
    return norm


@torch.no_grad()
def sharded_ranks(
    model: nn.Module, batch, targets: list[int], seen: list[np.ndarray], chunk_elements: int = 2**26
) -> list[int]:
    """0-based full-corpus rank of each target (as ``metrics.target_rank``) for a model whose item table is
    sharded: every rank scores its rows in chunks of ``chunk_elements`` scores, counts the items above the
    target, and the counts are summed over the ranks. The padding item 0, the target and the user's
    history ``seen`` never count; an item whose score is NaN counts as above, and a target whose score is not
    finite ranks last. Every rank must call it with the same batch."""
    table: ItemTable = model.encoder.items
    h = F.normalize(model.states(batch), dim=-1)[batch.offsets[1:] - 1]  # (B, D) each user's last state
    tgt = torch.tensor(targets, dtype=torch.int64, device=h.device)
    target_score = (h * F.normalize(table(tgt), dim=-1)).sum(-1)
    local, (start, end) = table.local_weight(), table.row_range()
    pairs = [
        (b, np.unique(np.concatenate([np.asarray(s, dtype=np.int64), [0, t]])))
        for b, (s, t) in enumerate(zip(seen, targets))
    ]
    ex_rows = torch.from_numpy(np.concatenate([np.full(len(c), b) for b, c in pairs])).to(h.device)
    ex_cols = torch.from_numpy(np.concatenate([c for _, c in pairs])).to(h.device)
    keep = (ex_cols >= start) & (ex_cols < end)
    ex_rows, ex_cols = ex_rows[keep], ex_cols[keep] - start
    above = torch.zeros(len(targets), dtype=torch.int64, device=h.device)
    step = max(1, chunk_elements // max(1, len(targets)))
    for c0 in range(0, end - start, step):
        scores = h @ F.normalize(local[c0 : c0 + step], dim=-1).T
        here = (ex_cols >= c0) & (ex_cols < c0 + scores.shape[1])
        scores[ex_rows[here], ex_cols[here] - c0] = -math.inf
        above += ((scores > target_score[:, None]) | scores.isnan()).sum(1)
    dist.all_reduce(above, group=table.group)
    last = torch.tensor([table.num_rows - len(c) for _, c in pairs], device=h.device)  # candidates less one
    return torch.where(torch.isfinite(target_score), above, last).tolist()
