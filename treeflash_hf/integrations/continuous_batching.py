"""TreeFlash inside transformers' continuous batching (`generate_batch`, `cache_implementation="paged"`,
`continuous_batching_context_manager`, `init_continuous_batching`, `transformers serve --continuous-batching`).

Given a TreeFlash drafter (`assistant_model=` on any of those entry points, or a TreeFlash model folder loaded with
`trust_remote_code`), continuous batching returns a `TreeFlashContinuousBatchingManager`: transformers' own manager
(its request queue, cancellation, result routing, streaming, background thread and stop/pause protocol), whose
batch processor is TreeFlash's decoding loop instead of the paged engine. Between two steps, requests that arrived
are prefilled (each alone, as offline decoding would) and join the working batch, finished and cancelled ones leave
it with their caches and drafter state; each step drafts for every decoding request in one batched drafter forward,
verifies every request's tree in one target forward and commits each request's accepted path (`generation.Decoder`,
the loop `generate()` runs). Each request attends only its own cache slots (a per-row cache with a tree mask, not
the paged engine's CPU path that attends every query over all requests' keys), and under `tree_budget="auto"` the
tree widths follow the measured verification cost at the current number of requests, down to plain one-token steps.

Everything that reaches into transformers' continuous-batching internals lives in this module: the entry points are
wrapped once (`install_continuous_batching_guards`), the manager subclass overrides `_create_batch_processor`,
`switch_to_cb_friendly_attn` and `warmup`. Tested with transformers `TESTED_TRANSFORMERS`; outside that range, or
under tensor parallelism, a TreeFlash request for continuous batching logs one warning and runs stock (plain)
continuous batching.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import queue
import time
from collections import OrderedDict
from typing import Callable

import torch
import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig, DynamicCache
from transformers.generation.continuous_batching.continuous_api import (
    BackgroundThreadStatus,
    ContinuousBatchingManager,
    ContinuousMixin,
)
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

from ..engine.accept import RowProcessor, choose_token
from ..engine.cache import growing_cache
from ..engine.draft import TreeDrafter
from ..engine.decode import Decoder, Rows
from ..engine.learned import learned_state
from ..engine.options import TreeOptions
from ..engine.sync import DecisionSync
from ..engine.validation import TREE_MASK_BACKENDS, TreeFlashInputError, check_pair, is_treeflash_drafter

logger = logging.getLogger(__name__)

TESTED_TRANSFORMERS = (Version("5.24.0"), Version("5.25.0"))  # [low, high): the internals this module relies on
FOLDER_MARK = "_treeflash_folder_generate"  # on a TreeFlash folder's `generate` function
FOLDER_DRAFTER = "_treeflash_folder_drafter"  # on it too: the function that loads the folder's drafter
WARNED_ATTRIBUTE = "_treeflash_plain_cb_warned"  # on a model, once it has warned that TreeFlash is off
GUARD_MARK = "_treeflash_guard"  # on ContinuousMixin's methods, once wrapped (by any copy of this module)
DEFAULT_MAX_REQUESTS = 32  # requests decoding at once when the continuous-batching config sets no limit
# While others decode, a request waits up to this long after its arrival for more arrivals to be prefilled with it:
# a prefill forward costs about what a decode step does, whatever its few prompts (closed-loop clients whose
# requests finished in the same step send their next ones within milliseconds of each other).
PREFILL_GATHER_S = 0.015

# The drafter a `generate_batch` / `continuous_batching_context_manager` call was given, for the
# `init_continuous_batching` it makes (stock signatures have no place for it).
_REQUESTED_DRAFTER: contextvars.ContextVar = contextvars.ContextVar("treeflash_cb_drafter", default=None)


# ---- deciding who decodes -------------------------------------------------------------------------------------------
def mark_folder_generate(generate: Callable, load_drafter: Callable) -> Callable:
    """Mark `generate` as a TreeFlash model folder's own `generate()`, whose drafter `load_drafter(model)` loads."""
    setattr(generate, FOLDER_MARK, True)
    setattr(generate, FOLDER_DRAFTER, load_drafter)
    return generate


def folder_drafter_loader(model) -> Callable | None:
    """The drafter loader of a model loaded from a TreeFlash model folder with trust_remote_code (transformers then
    sets `model.generate = functools.partial(<the folder's generate>, model=model)`), else None."""
    function = getattr(model.__dict__.get("generate"), "func", None)
    return getattr(function, FOLDER_DRAFTER, None) if getattr(function, FOLDER_MARK, False) else None


def is_treeflash_folder(model) -> bool:
    return folder_drafter_loader(model) is not None


def warn_plain_continuous_batching(model, reason: str) -> None:
    """Say once per model that continuous batching decodes with the plain target, and why."""
    if model.__dict__.get(WARNED_ATTRIBUTE):
        return
    model.__dict__[WARNED_ATTRIBUTE] = True
    logger.warning("TreeFlash is off for continuous batching: %s. %s decodes with the plain target (stock "
                   "continuous batching); for TreeFlash, call generate() without cache_implementation='paged'.",
                   reason, model.name_or_path)


def unsupported_reason(model) -> str | None:
    """Why TreeFlash cannot run inside continuous batching for `model` here, or None."""
    version = Version(Version(transformers.__version__).base_version)
    if not TESTED_TRANSFORMERS[0] <= version < TESTED_TRANSFORMERS[1]:
        return (f"transformers {transformers.__version__} is outside the range this engine was tested with "
                f"(>= {TESTED_TRANSFORMERS[0]}, < {TESTED_TRANSFORMERS[1]})")
    if getattr(model, "_device_mesh", None) is not None:
        return "the target is tensor-parallel, which TreeFlash's continuous batching does not support yet"
    return None


def requested_drafter(model, kwargs: dict):
    """The TreeFlash drafter continuous batching should decode `model` with: `assistant_model` (popped from
    `kwargs`), else the one the enclosing `generate_batch` call was given, else a TreeFlash folder's own; None for
    plain continuous batching. Any other assistant model raises (continuous batching has no other speculation)."""
    drafter = kwargs.pop("assistant_model", None) or _REQUESTED_DRAFTER.get()
    if drafter is None and is_treeflash_folder(model):
        drafter = folder_drafter_loader(model)(model)
    if drafter is not None and not is_treeflash_drafter(drafter):
        raise TreeFlashInputError(
            f"Continuous batching takes a TreeFlash drafter as `assistant_model` (got {type(drafter).__name__}); "
            "transformers' continuous batching has no other speculative decoding. Drop `assistant_model` for plain "
            "continuous batching, or call generate() without cache_implementation='paged' for assisted decoding."
        )
    return drafter


@contextlib.contextmanager
def drafter_for_continuous_batching(drafter):
    """Within the block, continuous batching set up on this thread (`init_continuous_batching`) uses `drafter`."""
    token = _REQUESTED_DRAFTER.set(drafter)
    try:
        yield
    finally:
        _REQUESTED_DRAFTER.reset(token)


def paged_generate(stock_generate, model, args, kwargs: dict, drafter):
    """`generate(..., assistant_model=drafter, cache_implementation="paged")`: transformers' own paged path (it
    calls `generate_batch` and returns its `[1, B, S + new]` tensor), decoding with TreeFlash."""
    with drafter_for_continuous_batching(drafter):
        return stock_generate(model, *args, **kwargs)


# ---- the batch processor: TreeFlash's decoding loop over requests that come and go -----------------------------------
class TreeFlashBatchProcessor:
    """What `ContinuousBatchingManager`'s background loop drives (`prepare_next_batch` -> `_generation_step` ->
    `update_batch`), running TreeFlash over a working batch whose rows are requests.

    waiting: requests not yet prefilled, in arrival order; active: request states by id (decoding);
    rows / cache: the working batch (`generation.Rows`) and its target cache (None while no request decodes);
    row_steps / accepted_tokens: over the processor's life, request-steps verified and drafted tokens accepted
    (τ = 1 + accepted_tokens / row_steps)."""

    use_async_batching = False
    inputs_and_outputs = None  # (the manager checks it for async IO pairs)

    def __init__(self, manager: "TreeFlashContinuousBatchingManager"):
        self.model = manager.model
        self.drafter = manager.drafter
        self.options = manager.tree_options
        self.generation_config = manager.generation_config
        self.input_queue = manager.input_queue
        self.cancel_queue = manager.cancel_queue
        self.output_router = manager.output_router
        self.background_thread_status = manager.background_thread_status
        limit = manager.continuous_batching_config.max_requests_per_batch
        self.max_requests = limit if limit else DEFAULT_MAX_REQUESTS
        text_config = self.model.config.get_text_config()
        self.max_positions = getattr(text_config, "max_position_embeddings", None)
        self.logits_processor = self.model._get_logits_processor(self.generation_config)
        self.do_sample = bool(self.generation_config.do_sample)
        self.decoder: Decoder | None = None  # made in the generation thread (learned state is per thread)
        self.waiting: OrderedDict[str, RequestState] = OrderedDict()
        self.active: dict[str, RequestState] = {}
        self.row_steps = 0
        self.accepted_tokens = 0
        self.request_ids: dict[int, str] = {}  # row id -> request id
        self.next_row_id = 0
        self.rows: Rows | None = None
        self.cache = None
        self.outputs = []

    # ---- requests in and out ----
    def reset(self) -> None:
        """Forget every request and the working batch (a new generation loop)."""
        self.waiting.clear()
        self.active.clear()
        self.request_ids.clear()
        self.drop_batch()

    def drop_batch(self) -> None:
        self.rows, self.cache = None, None
        if self.decoder is not None:
            self.decoder.generator.reset()

    @property
    def tau(self) -> float:
        """Tokens emitted per request-step so far (accepted drafted tokens + the bonus token)."""
        return 1.0 + self.accepted_tokens / self.row_steps if self.row_steps else float("nan")

    def has_pending_requests(self) -> bool:
        return bool(self.waiting or self.active)

    def _handle_request_error(self, error: Exception, state: RequestState) -> None:
        self.output_router.fail_and_deliver(state, error)

    def fail_all_requests(self, error: Exception) -> None:
        for state in [*self.active.values(), *self.waiting.values()]:
            self._handle_request_error(error, state)
        self.reset()

    def request_error(self, state: RequestState) -> str | None:
        """Why a request cannot be decoded here, or None."""
        if not state.initial_tokens:
            return "The prompt is empty: send at least one token."
        if state.logit_processor_kwargs:
            return (f"Per-request logits-processor settings {sorted(state.logit_processor_kwargs)} are not supported "
                    "by TreeFlash's continuous batching: set sampling in the generation config.")
        needed = len(state.initial_tokens) + (state.max_new_tokens or 0)
        if self.max_positions is not None and needed > self.max_positions:
            return (f"The request needs {needed} positions (a {len(state.initial_tokens)}-token prompt plus "
                    f"max_new_tokens={state.max_new_tokens}), more than the model's {self.max_positions}: shorten "
                    "the prompt or lower max_new_tokens.")
        return None

    def prepare_next_batch(self) -> bool:
        """Take in new requests and cancellations; True while some request waits or decodes. (Single process: the
        stop status this rank asked for is the group's.)"""
        status = self.background_thread_status
        status.update_with_tp_status(status.local_status)
        if status.tp_status == BackgroundThreadStatus.HARD_STOP:
            return False
        if status.is_pause_requested():
            status.pause_and_wait()
        self.take_new_requests()
        for request_id in drain(self.cancel_queue):
            self.cancel(request_id)
        return self.has_pending_requests()

    def take_new_requests(self) -> None:
        for state in drain(self.input_queue):
            error = self.request_error(state)
            if error is not None:
                self._handle_request_error(TreeFlashInputError(error), state)
            else:
                self.waiting[state.request_id] = state

    def gather_arrivals(self) -> None:
        """While requests decode, let the newest waiting request wait until it is `PREFILL_GATHER_S` old, then
        take what arrived meanwhile: one prefill forward for all of them instead of one each."""
        if self.rows is None or not self.waiting:
            return
        newest = max(state.created_time for state in self.waiting.values())
        delay = PREFILL_GATHER_S - (time.perf_counter() - newest)
        if delay > 0:
            time.sleep(delay)
            self.take_new_requests()

    def cancel(self, request_id: str) -> None:
        """Drop a request: waiting, or decoding (its rows leave both caches)."""
        self.waiting.pop(request_id, None)
        if request_id in self.active and self.rows is not None:
            self.leave([self.request_ids[row_id] == request_id for row_id in self.rows.ids])

    def leave(self, finished: list[bool]) -> None:
        """Rows flagged in `finished` leave the working batch with their cache slots and drafter state."""
        for row_id, flag in zip(list(self.rows.ids), finished):
            if flag:
                request_id = self.request_ids.pop(row_id)
                self.active.pop(request_id, None)
        self.rows.leave(finished, self.cache, self.decoder.generator)
        if not len(self.rows):
            self.drop_batch()

    # ---- the step ----
    def ensure_decoder(self) -> Decoder:
        if self.decoder is None:
            target, sync = self.model, DecisionSync(self.model)
            self.decoder = Decoder(
                target=target, generator=TreeDrafter(self.drafter, target, self.options),
                options=self.options,
                learned=learned_state(self.drafter, target, self.options, self.generation_config, sync),
                process=RowProcessor(self.logits_processor, 1), do_sample=self.do_sample, sync=sync,
                device=target.get_input_embeddings().weight.device,
            )
        return self.decoder

    def emit(self, state: RequestState, rows: Rows, row: int, token: int) -> bool:
        """Commit one token to a request (its row's sequence and its state); True when the request is finished."""
        rows.token_ids[row].append(token)
        return state.update_and_check_completion(token, None)

    def report(self, state: RequestState) -> None:
        """Queue the request's output for delivery: every step while it streams, else once it is finished."""
        if state.streaming or state.status >= RequestStatus.FINISHED:
            self.outputs.append(state.to_generation_output())

    def admit(self) -> None:
        """Prefill the waiting requests the batch has room for, in one left-padded forward; their first tokens go
        out at once, and the requests that go on join the working batch."""
        decoder = self.ensure_decoder()
        self.gather_arrivals()
        room = self.max_requests - (len(self.rows) if self.rows is not None else 0)
        states = [self.waiting.popitem(last=False)[1] for _ in range(min(room, len(self.waiting)))]
        if not states:
            return
        prompts = [state.initial_tokens for state in states]
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        row_ids = list(range(self.next_row_id, self.next_row_id + len(states)))
        self.next_row_id += len(states)
        no_limit = self.max_positions or 2**31  # max_new_tokens=None: up to the model's positions
        limits = [no_limit if state.max_new_tokens is None else len(state.initial_tokens) + state.max_new_tokens
                  for state in states]
        for state in states:
            state.status = RequestStatus.PREFILLING
        cache = growing_cache(DynamicCache(config=self.model.config))
        device = decoder.device
        rows, raw = decoder.prefill(input_ids.to(device), attention_mask.to(device), position_ids.to(device), cache,
                                    limits, row_ids)
        # each request's own tokens from here on (its padding lives only in the cache's invalid slots)
        rows.token_ids = [list(prompt) for prompt in prompts]
        rows.pads = [0] * len(prompts)
        tokens = []
        for row, (state, row_id) in enumerate(zip(states, row_ids)):
            logits = raw[row : row + 1]
            processed = decoder.process(row_id, rows.sequence(row), logits.clone()) if len(decoder.process) else logits
            tokens.append(choose_token(processed, self.do_sample))
        rows.root_tokens = decoder.sync.share_ints(tokens)
        finished = []
        for row, (state, row_id, token) in enumerate(zip(states, row_ids, rows.root_tokens)):
            state.status = RequestStatus.DECODING
            self.active[state.request_id] = state
            self.request_ids[row_id] = state.request_id
            finished.append(self.emit(state, rows, row, token))
            self.report(state)
        self.update_batch()  # first tokens out now, not after the next step
        if self.rows is None:
            self.rows, self.cache = rows, cache
            decoder.generator.reset()
        else:
            self.rows.join([(rows, cache)], self.cache, decoder.generator)
        if any(finished):
            self.leave([False] * (len(self.rows) - len(finished)) + finished)

    def decode(self) -> None:
        """One TreeFlash step over every decoding request."""
        rows = self.rows
        states = [self.active[self.request_ids[row_id]] for row_id in rows.ids]
        step, finished = self.decoder.advance(
            rows, self.cache, lambda row, token, *_: self.emit(states[row], rows, row, token))
        self.row_steps += len(step.accepted)
        self.accepted_tokens += sum(len(result.path) for result in step.accepted)
        for state in states:
            self.report(state)
        if any(finished):
            self.leave(finished)

    @torch.no_grad()
    def _generation_step(self, model) -> None:
        """Admit waiting requests, then one step over the working batch."""
        self.admit()
        if self.rows is not None:
            self.decode()

    def update_batch(self) -> None:
        """Deliver this step's outputs (every new token of streaming requests; finished requests)."""
        outputs, self.outputs = self.outputs, []
        if outputs:
            self.output_router.deliver_batch(outputs)

    def warmup(self, model) -> None:
        """Nothing to capture (no CUDA graphs): the first step builds what it needs."""


def drain(source: queue.Queue | None) -> list:
    items = []
    while source is not None:
        try:
            items.append(source.get_nowait())
        except queue.Empty:
            break
    return items


class TreeFlashContinuousBatchingManager(ContinuousBatchingManager):
    """transformers' `ContinuousBatchingManager` (same API: `add_request(s)`, `get_result`, `request_id_iter`,
    `register_result_handler`, `cancel_request`, `start`, `stop`, `pause`) decoding with TreeFlash: its batch
    processor is `TreeFlashBatchProcessor`. Made by `init_continuous_batching` when a TreeFlash drafter is given."""

    def __init__(self, model, drafter, generation_config, continuous_batching_config, workload_hints=None):
        check_pair(model, drafter)
        num_return_sequences = getattr(generation_config, "num_return_sequences", None) or 1
        if num_return_sequences > 1:
            raise TreeFlashInputError(
                f"num_return_sequences={num_return_sequences}: TreeFlash's continuous batching returns one sequence "
                "per request; send the prompt several times (with do_sample=True) instead.")
        if getattr(continuous_batching_config, "return_logprobs", False):
            raise TreeFlashInputError(
                "return_logprobs=True: TreeFlash's continuous batching does not return log-probabilities yet; drop "
                "it from the ContinuousBatchingConfig (or drop the drafter for plain continuous batching).")
        self.drafter = drafter
        self.tree_options = TreeOptions.resolve(drafter, {})
        super().__init__(model, generation_config, continuous_batching_config, workload_hints)
        self._use_prefix_sharing = False  # requests keep their order; no paged cache to share
        logger.info("TreeFlash continuous batching: %s decodes with drafter %s (%s).", model.name_or_path,
                    drafter.name_or_path, self.tree_options)

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        """Tree masks need an attention backend that takes a 4D mask: keep sdpa/eager, else switch to sdpa (restored
        at `stop`)."""
        original = model.config._attn_implementation
        if original in TREE_MASK_BACKENDS:
            return
        try:
            model.set_attn_implementation("sdpa")
        except Exception as err:
            raise TreeFlashInputError(
                f"The target uses attn_implementation={original!r}, which cannot take a tree attention mask, and it "
                "cannot switch to 'sdpa'. Load it with attn_implementation='sdpa' or 'eager'.") from err
        logger.warning("TreeFlash: attn_implementation=%r cannot take tree masks; continuous batching uses 'sdpa'.",
                       original)
        self._original_attn_impl = original

    def warmup(self) -> None:
        if self.batch_processor is None:
            self.batch_processor = self._create_batch_processor()
        self.warmed_up = True

    def _create_batch_processor(self) -> TreeFlashBatchProcessor:
        existing = getattr(self, "batch_processor", None)
        if isinstance(existing, TreeFlashBatchProcessor):
            existing.reset()
            return existing
        return TreeFlashBatchProcessor(self)


# ---- the entry points ---------------------------------------------------------------------------------------------
def _init_continuous_batching(stock_init: Callable, model, *args, **kwargs):
    drafter = requested_drafter(model, kwargs)
    if drafter is not None:
        reason = unsupported_reason(model)
        if reason is not None:
            warn_plain_continuous_batching(model, reason)
            drafter = None
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is not None and getattr(cached, "drafter", None) is not drafter:
        model.destroy_cached_continuous_batching_manager()  # made for another drafter (or none)
    if drafter is None or cached is not None and getattr(cached, "drafter", None) is drafter:
        return stock_init(model, *args, **kwargs)
    names = ("generation_config", "continuous_batching_config", "workload_hints")
    settings = {**dict(zip(names, args)), **kwargs}
    generation_config = settings.get("generation_config") or model.generation_config
    if generation_config.eos_token_id is None:
        generation_config.eos_token_id = -1  # as stock: no EOS
    cb_config = settings.get("continuous_batching_config")
    if cb_config is None:
        cb_config = getattr(generation_config, "continuous_batching_config", None) or ContinuousBatchingConfig()
    return TreeFlashContinuousBatchingManager(model, drafter, generation_config, cb_config,
                                              settings.get("workload_hints"))


def _with_drafter(method: Callable) -> Callable:
    """`generate_batch` / `continuous_batching_context_manager` taking `assistant_model=` for the manager they
    make (stock `generate_batch` takes `**kwargs` and would silently drop it)."""

    @functools.wraps(method)
    def wrapped(self, *args, assistant_model=None, **kwargs):
        if assistant_model is None:
            return method(self, *args, **kwargs)
        if not is_treeflash_drafter(assistant_model):
            requested_drafter(self, {"assistant_model": assistant_model})  # raises the error
        with drafter_for_continuous_batching(assistant_model):
            return method(self, *args, **kwargs)

    return wrapped


def _context_manager_with_drafter(method: Callable) -> Callable:
    @functools.wraps(method)
    @contextlib.contextmanager
    def wrapped(self, *args, assistant_model=None, **kwargs):
        if assistant_model is not None and not is_treeflash_drafter(assistant_model):
            requested_drafter(self, {"assistant_model": assistant_model})  # raises the error
        with drafter_for_continuous_batching(assistant_model or _REQUESTED_DRAFTER.get()):
            manager_context = method(self, *args, **kwargs)
            manager = manager_context.__enter__()
        try:
            yield manager
        except BaseException as err:
            if not manager_context.__exit__(type(err), err, err.__traceback__):
                raise
        else:
            manager_context.__exit__(None, None, None)

    return wrapped


def install_continuous_batching_guards() -> None:
    """Wrap `ContinuousMixin.init_continuous_batching` (a TreeFlash drafter or folder gets TreeFlash's manager),
    `generate_batch` and `continuous_batching_context_manager` (they take `assistant_model=`). The class is wrapped
    because transformers runs none of a folder's code with the model in hand when it loads it; other models take
    the stock path unchanged. Idempotent, also across copies of this module (a folder's `custom_generate/` and the
    installed package)."""
    init = ContinuousMixin.init_continuous_batching
    if not getattr(init, GUARD_MARK, False):
        def init_continuous_batching(self, *args, **kwargs):
            return _init_continuous_batching(init, self, *args, **kwargs)

        init_continuous_batching = functools.wraps(init)(init_continuous_batching)
        setattr(init_continuous_batching, GUARD_MARK, True)
        ContinuousMixin.init_continuous_batching = init_continuous_batching
    for name, wrap in (("generate_batch", _with_drafter),
                       ("continuous_batching_context_manager", _context_manager_with_drafter)):
        method = getattr(ContinuousMixin, name)
        if not getattr(method, GUARD_MARK, False):
            wrapped = wrap(method)
            setattr(wrapped, GUARD_MARK, True)
            setattr(ContinuousMixin, name, wrapped)
