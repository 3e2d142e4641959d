"""Linear layers through oneDNN with weights packed once, for CPUs where torch's default product is slow at the few
rows a decode or verify step multiplies.

torch's CPU wheels send a float32 `F.linear` to MKL's sgemm, which on some CPUs (an AVX2-only AMD EPYC) is slow at
2-17 rows, and a bfloat16 one to oneDNN with the weight in its plain layout, reordered at every call. oneDNN with the
weight packed once for the row count a verify step multiplies (the op torch's own compiler emits for frozen CPU
graphs) is up to 2-4x faster there (docs/results.md, "Linear layers through oneDNN's packed weights").
`pack_linears` switches a model's plain float32 or bfloat16 `nn.Linear` layers to that path; `plan_packed_linears`
times both kernels on the models' own shapes and row counts, so each layer takes the packed one from the row count
where it is faster, and a CPU where the stock kernel is the faster keeps it; `pack_where_faster` does both.

The packed copy is a cache beside the weight, not a replacement (a second copy of every packed weight in memory: the
plan packs nothing where that would take more than `MEMORY_SHARE` of the memory available): `state_dict`, tied weights
and `save_pretrained` stay the stock ones, and a weight changed in place (`load_state_dict`) or replaced is packed
again at the next forward.
The two kernels round differently (as torch's own kernels for different row counts do: float32 products differ by ~1e-6
relative, bfloat16 ones by its rounding), so a packed model is a different run of the same weights in the same dtype:
compare outputs within one setting.

`cpu_has_native` / `bfloat16_is_fast`: whether this CPU has half-precision arithmetic at all (without it torch emulates
bfloat16 several times slower than float32): `dtype="auto"` and the training recipes choose their dtype by it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.onednn import note_packing, pack_weight, packable_dtypes, packed_product

logger = logging.getLogger(__name__)

ROWS_HINT = 17  # a verify step's rows at tree budget 16: the row count oneDNN lays the weights out for
PROBE_ROWS = (1, 2, 4)  # the few-row products timed for where the stock kernel stops being the faster
VERIFY_MARGIN = 0.9  # packed only when clearly faster (timing noise) where speculation spends its time
MEMORY_SHARE = 0.5  # the packed copies may take at most this share of the memory available when planned
HALF_PRECISIONS = (torch.bfloat16, torch.float16)


def _arm_cpu_features() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.lower().startswith("features") for flag in line.split()[2:]}


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices in hardware: bfloat16 with AVX512-BF16 or AMX (x86) or BF16 (Arm),
    float16 with AMX-FP16 (x86) or FP16 arithmetic (Arm). Without it torch emulates them: on a 2-core AVX2 EPYC a
    bfloat16 forward of SmolLM2-135M over 16 tokens took 2.6x the float32 one (docs/results.md, "run dtype")."""
    if dtype not in HALF_PRECISIONS:
        return True
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        check = {torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
                 torch.float16: ("_is_amx_fp16_supported",)}[dtype]
        return any(getattr(torch.cpu, name, lambda: False)() for name in check)
    features = _arm_cpu_features()
    return ("bf16" if dtype == torch.bfloat16 else "asimdhp") in features


def bfloat16_is_fast(device: str | torch.device) -> bool:
    """Whether bfloat16 arithmetic is the fast choice on `device`: any accelerator, or a CPU that has it in hardware
    (`cpu_has_native`); other CPUs emulate it several times slower than float32."""
    return torch.device(device).type != "cpu" or cpu_has_native(torch.bfloat16)


class PackedLinear(nn.Linear):
    """An `nn.Linear` (its class swapped in place by `pack_linears`) whose CPU forward multiplies by a oneDNN copy of
    its weight. Anything else (an input of another dtype or device, a graph being compiled, a product autograd records:
    the packed op has no backward, at most `stock_max_rows` rows) runs the stock `F.linear`."""

    packed_rows_hint: int = ROWS_HINT
    stock_max_rows: int = 0  # inputs of at most this many rows take the stock product (timed faster there)

    def __getstate__(self) -> dict:
        """Copied or pickled without the packed copy (an opaque oneDNN tensor: a cache, packed again when used) and
        without the engine's group of fused layers (it names the original layers)."""
        state = self.__dict__.copy()
        state.pop("_packed", None)
        state.pop("fused_group", None)  # (the engine's grouping of the original layers, `engine/onednn.py`)
        return state

    @property
    def cost_key(self) -> str:
        """What sets this layer's cost, for the cost curve's cache key (`engine/budget.py`, `model_key`)."""
        return f"oneDNN packed {tuple(self.weight.shape)} over {self.stock_max_rows} rows"

    def takes_packed(self, input: torch.Tensor) -> bool:
        """Whether this layer multiplies `input` by its packed weight (else the stock `F.linear`)."""
        weight = self.weight
        return not (torch.compiler.is_compiling() or input.device.type != "cpu" or input.dtype != weight.dtype
                    or (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))  # (no backward)
                    or weight.dtype not in packable_dtypes() or type(weight) is not nn.Parameter  # (quantized since)
                    or input.numel() <= self.stock_max_rows * self.in_features)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        fused = self.__dict__.get("fused_group")  # (inside the engine's forwards: `engine.onednn.fused_products`)
        if fused is not None and (output := fused[0].computed(fused[1], input)) is not None:
            return output  # (from the product a layer of its group computed for this same input)
        weight = self.weight
        if not self.takes_packed(input):
            return F.linear(input, weight, self.bias)
        if fused is not None and fused[0].serves(input):
            return fused[0].output(fused[1], input)
        # packed again when the weight was replaced, written in place (its version) or given new storage (`.data =`)
        key = (id(weight), weight._version, weight.data_ptr())
        state = getattr(self, "_packed", None)
        if state is None or state[0] != key:
            state = (key, pack_weight(weight, self.packed_rows_hint), weight)  # (the weight kept: its id stays unique)
            self._packed = state
        return packed_product(input, state[1], self.bias)


def can_pack(module: nn.Module) -> bool:
    """A plain CPU `nn.Linear` in a `packable_dtypes()` dtype (not a quantized or sharded subclass, not a tensor
    subclass weight)."""
    return (type(module) in (nn.Linear, PackedLinear) and type(module.weight) is nn.Parameter
            and module.weight.dtype in packable_dtypes() and module.weight.device.type == "cpu"
            and (module.bias is None or module.bias.dtype == module.weight.dtype))


def pack_linears(model: nn.Module, plan: dict[tuple[int, int], int] | None = None, rows_hint: int = ROWS_HINT) -> int:
    """Switch `model`'s plain CPU linear layers (`can_pack`) to `PackedLinear` (in place; `unpack_linears` undoes it).
    `plan`: `plan_packed_linears`'s answer, `(out_features, in_features)` -> the most rows that stay on the stock
    product, a shape it leaves out staying stock (None: every layer, packed at every row count). `rows_hint`: the row
    count oneDNN lays the weights out for. Returns the number of layers switched."""
    count = 0
    for module in model.modules():
        if can_pack(module):
            shape = tuple(module.weight.shape)
            if plan is not None and shape not in plan:
                continue
            module.__class__ = PackedLinear
            module.packed_rows_hint = rows_hint
            module.stock_max_rows = 0 if plan is None else plan[shape]
            module.__dict__.pop("_packed", None)
            count += 1
    note_packing()
    return count


def is_packed(model: nn.Module) -> bool:
    """Whether any of `model`'s linear layers runs packed."""
    return any(type(module) is PackedLinear for module in model.modules())


def kernels_note(packed: bool) -> str:
    """The phrase the printers add to a run's dtype when its linear layers ran packed ("" when they did not)."""
    return ", linear layers packed for oneDNN" if packed else ""


def unpack_linears(model: nn.Module) -> int:
    """Back to stock `nn.Linear` layers and their packed copies freed. Returns the number of layers switched back."""
    count = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("_packed", None)
            module.__dict__.pop("packed_rows_hint", None)
            module.__dict__.pop("stock_max_rows", None)
            module.__dict__.pop("fused_group", None)  # (the engine groups the layers that are packed)
            count += 1
    note_packing()
    return count


@contextlib.contextmanager
def stock_kernels(*models: nn.Module):
    """Within the block the models' packed layers run torch's stock product (their packed copies and plan kept, and
    back in use after): plain decoding as `from_pretrained` alone gives it, beside the packed run (the bench's
    `stock_kernels`)."""
    switched = [module for model in models for module in model.modules() if type(module) is PackedLinear]
    for module in switched:
        module.__class__ = nn.Linear
    try:
        yield
    finally:
        for module in switched:
            module.__class__ = PackedLinear


def available_memory_bytes() -> int | None:
    """The memory available to new allocations (Linux's MemAvailable), or None where it is not known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def linear_shapes(*models: nn.Module, dtype: torch.dtype | None = None) -> dict[tuple[int, int], int]:
    """`(out_features, in_features)` of the packable layers (of `dtype` only, when given), with how many layers have
    each."""
    shapes: dict[tuple[int, int], int] = {}
    for model in models:
        for module in model.modules():
            if can_pack(module) and dtype in (None, module.weight.dtype):
                shape = tuple(module.weight.shape)
                shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


@functools.lru_cache(maxsize=8)
def _timed_plan(shapes: tuple[tuple[tuple[int, int], int], ...], rows: int, threads: int,
                dtype: torch.dtype) -> tuple[tuple[tuple[int, int], int], ...] | None:
    torch.manual_seed(0)
    row_counts = tuple(sorted({*PROBE_ROWS, rows}))
    stock = dict.fromkeys(row_counts, 0.0)  # every layer on the stock product, weighted by how many have the shape
    chosen = dict.fromkeys(row_counts, 0.0)  # every layer on the kernel the plan gives it
    plan = []
    for (out_features, in_features), count in shapes:
        weight = torch.randn(out_features, in_features).to(dtype)
        packed_weight = pack_weight(weight, rows)
        repeats = 3 if out_features * in_features > 8_000_000 else 9  # an output head is timed fewer times
        times = {}
        for r in row_counts:
            x = torch.randn(r, in_features).to(dtype)
            times[r] = (_median_seconds(lambda: F.linear(x, weight), repeats),
                        _median_seconds(lambda: packed_product(x, packed_weight, None), repeats))
        # the stock product below the first timed row count where the packed one is faster; never faster: not packed
        crossover = next((r for r in row_counts if times[r][1] < times[r][0]), None)
        if crossover is not None:
            plan.append(((out_features, in_features), max((r for r in row_counts if r < crossover), default=0)))
        for r in row_counts:
            stock[r] += count * times[r][0]
            chosen[r] += count * times[r][crossover is not None and r >= crossover]
    worth_it = bool(plan) and chosen[rows] <= VERIFY_MARGIN * stock[rows]
    logger.info("%s linear layers at 1 / %d rows: stock %.1f / %.1f ms, packed where faster %.1f / %.1f ms: %s",
                str(dtype).removeprefix("torch."), rows, stock[1] * 1e3, stock[rows] * 1e3, chosen[1] * 1e3,
                chosen[rows] * 1e3, "packed" if worth_it else "stock")
    return tuple(plan) if worth_it else None


def plan_packed_linears(*models: nn.Module, rows: int = ROWS_HINT) -> dict[tuple[int, int], int] | None:
    """Which of these models' linear layers to pack, and up to how many rows each keeps the stock product:
    `(out_features, in_features)` -> rows, for `pack_linears`. Each shape is timed on both kernels, in the layers'
    dtype, at 1, 2, 4 and `rows` rows (a verify step) and takes the packed one from the first row count where it is
    faster (float32 on the AVX2 EPYC: the output head from one row, the small layers from two; bfloat16 on a Xeon
    with AMX: every layer from one). None (stay stock) unless the layers, weighted by how many have each shape, then
    multiply `rows` rows in at most `VERIFY_MARGIN` of the stock time; None too when there is nothing to pack, the
    layers mix dtypes, their packed copies would take more than `MEMORY_SHARE` of the memory available, or this torch
    has no oneDNN. Timed once per process, set of shapes, dtype and thread count
    (~2 s for a 135M model)."""
    dtypes = {module.weight.dtype for model in models for module in model.modules() if can_pack(module)}
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    shapes = linear_shapes(*models, dtype=dtype)
    copies = sum(count * out_features * in_features for (out_features, in_features), count in shapes.items()) \
        * dtype.itemsize
    available = available_memory_bytes()
    if available is not None and copies > MEMORY_SHARE * available:
        logger.info("linear layers stay stock: their packed copies (%.1f GB) would take more than %d%% of the memory "
                    "available (%.1f GB)", copies / 1e9, MEMORY_SHARE * 100, available / 1e9)
        return None
    plan = _timed_plan(tuple(sorted(shapes.items())), rows, torch.get_num_threads(), dtype)
    return None if plan is None else dict(plan)


def pack_where_faster(*models: nn.Module, rows: int = ROWS_HINT) -> bool:
    """`plan_packed_linears` on these models together, then `pack_linears` on each by that plan, with the weights laid
    out for the `rows` rows the plan was timed at (a verify step's, or a generation batch's). Returns whether any
    layer was packed."""
    plan = plan_packed_linears(*models, rows=rows)
    return plan is not None and sum(pack_linears(model, plan, rows_hint=rows) for model in models) > 0


__all__ = ["PackedLinear", "can_pack", "is_packed", "linear_shapes", "pack_linears", "pack_where_faster",
           "packable_dtypes", "plan_packed_linears", "stock_kernels", "unpack_linears"]
