"""oneDNN's linear product with the weight packed once for a row count (the op torch's own compiler emits for frozen
CPU graphs): the primitives `integrations/cpu_linear.py` runs a model's linear layers through, and that
`draft.TargetHead` scores a draft vocabulary's head rows with when the target's head runs through them."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN multiplies here: float32, and bfloat16 / float16 where the CPU has their arithmetic."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return ()
    half = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
            torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}
    return (torch.float32, *(dtype for dtype, supported in half.items() if supported()))


def pack_weight(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """`weight [out, in]` laid out by oneDNN for products of about `rows_hint` rows (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def packed_product(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`input [..., in] @ weight.T + bias` through `pack_weight`'s copy of the weight (no backward)."""
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")


# ---- Products fused across layers that read the same input ---------------------------------------------------------
# A verify forward multiplies a few rows by every weight, so each product costs mostly its call and a pass over its
# weight: the projections that read the same input (an attention's query, key and value; an MLP's gate and up) run
# as one product over their stacked weights inside the engine's forwards. Groups are found by these names among a
# module's children.
FUSED_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
FUSED_MAX_ROWS = 64  # the most rows a fused product serves: a verify step's (a longer prefill keeps each product)
_FUSION = threading.local()  # `.models`: ids of the models whose groups are on in this thread (`fused_products`)


@functools.cache
def fusion_is_exact(shapes: tuple[tuple[int, int], ...], dtype: torch.dtype, rows_hint: int, with_bias: bool,
                    threads: int) -> bool:
    """Whether one packed product over weights of `shapes` stacked gives, bit for bit, each weight's own packed
    product, at every row count 1..FUSED_MAX_ROWS (random weights and inputs: which products a kernel sums in what
    order depends on the shapes, not on the values). Checked once per shapes, dtype and thread count."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
    biases = [torch.randn(shape[0], generator=generator).to(dtype) if with_bias else None for shape in shapes]
    packed = [pack_weight(weight, rows_hint) for weight in weights]
    fused = pack_weight(torch.cat(weights), rows_hint)
    fused_bias = torch.cat(biases) if with_bias else None
    for rows in range(1, FUSED_MAX_ROWS + 1):
        input = torch.randn(rows, shapes[0][1], generator=generator).to(dtype)
        alone = torch.cat([packed_product(input, p, b) for p, b in zip(packed, biases)], dim=-1)
        if not torch.equal(alone, packed_product(input, fused, fused_bias)):
            return False
    return True


class FusedProducts:
    """Layers of one module that read the same input, each multiplying through its own packed weight
    (`integrations.cpu_linear.PackedLinear`), run as one product while `fused_products` is on for their model: the
    first member called computes every member's output, and the others take theirs while their input is that same
    tensor, unchanged (a different input: computed again). The outputs are the members' own packed products, bit for
    bit (`fusion_is_exact`, else the group is not used), as contiguous tensors. The stacked weight is packed again
    when a member's weight changes."""

    def __init__(self, members: list, owner: int):
        self.members = members
        self.owner = owner  # id of the model whose `fused_products` turns the group on
        self.sizes = [member.out_features for member in members]
        self.in_features = members[0].in_features
        first = members[0]  # (`can_fuse`: every member alike in dtype, packing and bias)
        self.kernel = (tuple(tuple(m.weight.shape) for m in members), first.weight.dtype, first.packed_rows_hint,
                       first.bias is not None)  # what `fusion_is_exact` is asked about, with the thread count
        self.local = threading.local()  # `.memo`: [input, its version, the outputs, members yet to take theirs]
        self.state = None  # (the members' weights' identity, the stacked packed weight, the stacked bias)

    def serves(self, input: torch.Tensor) -> bool:
        """Whether a member's packed product of `input` comes from the fused one: the group's model is on in this
        thread, the rows are a verify step's few, and fusing is exact here. (Asked by a member that takes its packed
        product at this row count, so every member does: `can_fuse` groups layers of one `stock_max_rows`.)"""
        if self.owner not in getattr(_FUSION, "models", ()):
            return False
        return (input.numel() <= FUSED_MAX_ROWS * self.in_features
                and fusion_is_exact(*self.kernel, torch.get_num_threads()))

    def computed(self, index: int, input: torch.Tensor) -> torch.Tensor | None:
        """Member `index`'s output for `input` when the fused product of this very input (unchanged since) is at
        hand in this thread, else None (what a member checks first: it was computed where `serves` said yes)."""
        memo = getattr(self.local, "memo", None)
        if memo is None or memo[0] is not input or memo[1] != input._version:
            return None
        memo[3] -= 1
        if not memo[3]:  # every member has had its output: hold nothing past the forward
            self.local.memo = None
        return memo[2][index]

    def output(self, index: int, input: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for `input` (`[..., in]` -> `[..., out]`), computing the fused product (where
        `serves`)."""
        outputs = self.product(input)
        self.local.memo = [input, input._version, outputs, len(self.members) - 1]
        return outputs[index]

    def product(self, input: torch.Tensor) -> list[torch.Tensor]:
        return [part.contiguous() for part in self.views(input)]

    def views(self, input: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every member's output for `input` as a view of the one fused product (`[..., out]` each, strided)."""
        identity = [(id(m.weight), m.weight._version, m.weight.data_ptr()) for m in self.members]
        if self.state is None or self.state[0] != identity:
            weight = torch.cat([member.weight.detach() for member in self.members])
            bias = None if self.members[0].bias is None else torch.cat([m.bias.detach() for m in self.members])
            self.state = (identity, pack_weight(weight, self.members[0].packed_rows_hint), bias)
        return packed_product(input, self.state[1], self.state[2]).split(self.sizes, dim=-1)

    def forget(self) -> None:
        """Drop this thread's memo (a member that was never called keeps it until here)."""
        self.local.memo = None


def can_fuse(members: list) -> bool:
    """Layers that multiply through packed weights (`PackedLinear`'s attributes) of one input size, dtype, device,
    row count where they start, and all or none with a bias."""
    first = members[0]
    return (all(hasattr(member, "packed_rows_hint") and type(member.weight) is torch.nn.Parameter
                for member in members)
            and len({(m.in_features, m.weight.dtype, m.weight.device, m.stock_max_rows, m.packed_rows_hint,
                      m.bias is None, None if m.bias is None else m.bias.dtype) for m in members}) == 1
            and first.weight.device.type == "cpu" and first.weight.dtype in packable_dtypes())


_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (packing count, its FusedProducts)
_PACKINGS = [0]  # how many times layers were packed or unpacked (`note_packing`): the groups found before are stale


def fused_views(members: tuple, input: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """`members`' outputs for `input` as views of their group's fused product, where the group is exactly these
    layers in this order and serves this call as it would serve the members called one by one (they take their
    packed products at this row count and `serves` says yes); else None. For a caller that reads its outputs as
    views (`lean_forward`): the members' own forwards hand out contiguous copies."""
    fused = members[0].__dict__.get("fused_group")
    if fused is None or fused[1] != 0 or fused[0].members != list(members):
        return None
    group = fused[0]
    if not (members[0].takes_packed(input) and group.serves(input)):
        return None
    return group.views(input)


def packing_count() -> int:
    """How many times layers were packed or unpacked in this process (a change of any model's kernels)."""
    return _PACKINGS[0]


def note_packing() -> None:
    """Called by `integrations.cpu_linear` whenever it packs or unpacks layers: `fused_groups` looks again."""
    _PACKINGS[0] += 1


def fused_groups(model) -> list[FusedProducts]:
    """`model`'s `FusedProducts`, found once per packing of its layers (each member is told its group and place:
    `fused_group`)."""
    kept = _GROUPS.get(model)
    if kept is not None and kept[0] == _PACKINGS[0]:
        return kept[1]
    groups = []
    for module in model.modules():
        for names in FUSED_NAMES:
            members = [getattr(module, name, None) for name in names]
            if all(isinstance(member, torch.nn.Linear) for member in members) and can_fuse(members):
                group = FusedProducts(members, id(model))
                for index, member in enumerate(members):
                    member.fused_group = (group, index)
                groups.append(group)
    _GROUPS[model] = (_PACKINGS[0], groups)
    return groups


@contextlib.contextmanager
def fused_products(model):
    """Run `model`'s `FusedProducts` inside the `with`, in this thread (the engine's own forwards); outside, every
    layer multiplies alone (the stock path stays stock)."""
    groups = fused_groups(model)
    if not groups:
        yield
        return
    previous = getattr(_FUSION, "models", frozenset())
    _FUSION.models = previous | {id(model)}
    try:
        yield
    finally:
        _FUSION.models = previous
        for group in groups:
            group.forget()
