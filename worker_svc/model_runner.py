"""The worker's core: apply a SchedulerOutput diff, run one forward pass, sample. No gRPC.

    runner = ModelRunner(ModelRunnerConfig(model=None))
    out = runner.execute_model(scheduler_output)   # out.sampled_token_ids[req_id] -> [token] or []

Each step packs every scheduled token of every request into one sequence (`input_ids` [T],
explicit positions): decodes first, sorted by context length (attention groups them), then
prefill chunks. The model implementation (worker_svc.model, over the op table the config's
`kernels` selects: worker_svc.ops) runs it and returns the logits of the last token of each
request that samples; the sampler picks the tokens. Transformers loads the weights (and is the
tests' oracle); its forward never runs here. Requests may run LoRA adapters (worker_svc.lora):
`load_lora` registers one (from any thread), each request's `lora_name` picks its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from common.messages import SchedulerOutput
from common.model_source import resolve_model
from common.tokenizer import load_tokenizer
from worker_svc import cpu_caps, decode_stack, spec_decode, token_mask
from worker_svc import runner_sizing as sizing
from worker_svc.config import ModelRunnerConfig
from worker_svc.cost_probe import time_throwaway_prefill
from worker_svc.cuda_graphs import DecodeGraphs
from worker_svc.host_memory import keep_freed_memory
from worker_svc.input_batch import InputBatch
from worker_svc.kv_cache import KVCache, bytes_per_block
from worker_svc.lora import BaseShapes, LoraAdapters, LoraInfo
from worker_svc.model import CausalLM
from worker_svc.model_loader import load_model, resolve_device, resolve_dtype
from worker_svc.native_attention import PagedDecodeKernel
from worker_svc.ops import NativeOps, select_ops
from worker_svc.sampler import Sampler, SamplingMetadata, TokenLogprobs, token_masks
from worker_svc.step_inputs import StepInputs, prepare_inputs
from worker_svc.structured_output import StructuredOutputs

log = logging.getLogger("splitserve.worker.model_runner")


@dataclass(slots=True)
class ModelRunnerOutput:
    # every scheduled request: [the sampled token], or [] when its step was a partial prefill
    sampled_token_ids: dict[str, list[int]]
    # requests that asked for logprobs: one entry per sampled token; None when none asked
    logprobs: dict[str, list[TokenLogprobs]] | None = None
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0


class ModelRunner:
    def __init__(self, config: ModelRunnerConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.ops = select_ops(self.device, self.dtype, config.kernels, config.quantization)
        self.native = isinstance(self.ops, NativeOps)
        if config.keep_freed_memory:  # host memory: the CPU path's activations, the swap pool
            keep_freed_memory()
        self.source = resolve_model(config.model)
        started = time.perf_counter()
        hf_model = load_model(self.source, self.dtype, self.device)
        self.model = CausalLM.from_hf(hf_model, self.ops)
        mc = hf_model.config.get_text_config()
        lora_base = BaseShapes.of(hf_model, self.model.spec.num_layers)
        self._max_model_len = sizing.max_model_len(mc, config.max_model_len)
        self._eos_token_id = sizing.eos_token_id(hf_model)
        del hf_model  # the model implementation holds what it needs (packed copies, on native)
        self.load_time_s = time.perf_counter() - started
        spec = self.model.spec
        self._vocab_size = spec.vocab_size
        num_layers, kv_heads, head_dim = spec.num_layers, spec.num_kv_heads, spec.head_dim

        per_block = bytes_per_block(num_layers, config.block_size, kv_heads, head_dim, self.dtype)
        num_blocks = config.num_gpu_blocks or sizing.kv_budget(config, self.device) // per_block
        num_host = config.num_host_blocks or config.swap_space // per_block
        self.kv_cache = KVCache(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=self.dtype,
            device=self.device,
            num_host_blocks=num_host,
            scratch_blocks=1,  # where a decode graph's padded rows write
        )
        self.batch = InputBatch(
            max_num_seqs=config.max_num_seqs,
            max_model_len=self._max_model_len,
            max_blocks_per_seq=-(-self._max_model_len // config.block_size),
            num_kv_blocks=num_blocks,
            vocab_size=self._vocab_size,
            device=self.device,
            max_logprobs=config.max_logprobs,
        )
        self.ops.bind_cache(self.kv_cache.key_caches[0], spec.num_heads, kv_heads, head_dim)
        if self.native:  # pure-decode steps in one native call, where every layer's kernel has one
            self.model.decode_step = decode_stack.build(self.model)
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graphs:
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                max_rows=config.max_num_seqs,
                max_blocks_per_seq=self.batch.block_table.shape[1],
                capture=True,
            )
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(
            generator,
            self.ops.fused.argmax if self.native and self.ops.fused else None,
            token_mask.load() if self.native else None,
        )
        self.structured = StructuredOutputs(
            lambda: load_tokenizer(self.source), self._vocab_size, self._eos_token_id
        )
        self.loras = LoraAdapters(
            config.max_loras, config.max_lora_rank, config.max_cpu_loras, lora_base, self.device
        )
        for name, path in config.lora_module_pairs():
            self.load_lora(name, path)
        log.info(
            "model %s loaded in %.1f s on %s/%s: %d KV blocks of %d, %d host blocks; kernels: %s",
            self.source.name,
            self.load_time_s,
            self.device,
            self.dtype,
            num_blocks,
            config.block_size,
            num_host,
            self.kernels,
        )

    # --- what the scheduler needs to know ---

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.kv_cache.num_host_blocks

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def model_name(self) -> str:
        return self.source.name

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def kernels(self) -> str:
        """One line: the CPU level and the kernel of each op family (registration, logs);
        "reference <device>" where torch's own ops run everything."""
        if not self.native:
            graphs = " cuda-graphs" if self.decode_graphs is not None else ""
            return f"reference {self.device.type}{graphs}"
        return (
            f"{cpu_caps.capabilities().level} linear={self.linear_kind} "
            f"decode-attention={'native' if self.decode_kernel else 'torch'} "
            f"prefill-attention={'native' if self.native_prefill else 'sdpa'} "
            f"elementwise={'native' if self.ops.fused else 'torch'} "
            f"forward={self.forward_path}"
        )

    @property
    def linear_kind(self) -> str:
        return self.ops.linear_kind if self.native else "torch"

    @property
    def decode_kernel(self) -> PagedDecodeKernel | None:
        return self.ops.attention_kernel

    @property
    def native_prefill(self) -> bool:
        return self.ops.native_prefill

    @property
    def forward_path(self) -> str:
        """What runs a step's layers: "model" (the layer loop), "model+decode-stack" (pure-decode
        steps in one native call), "model+cuda-graphs" (pure-decode steps replay a graph)."""
        if self.decode_graphs is not None:
            return "model+cuda-graphs"
        step = self.model.decode_step
        on = step is not None and getattr(step, "enabled", True)
        return "model+decode-stack" if on else "model"

    def warm_up(self, num_tokens: int) -> int:
        """One throwaway prefill of up to num_tokens tokens, finished at once. Without it the
        first long step of a fresh worker pays for page-faulting its activations' memory in,
        which makes that step markedly slower than the ones after it. Returns the tokens run."""
        n = min(
            num_tokens,
            self.config.max_num_batched_tokens,
            self.max_model_len - 1,
            self.num_blocks * self.block_size,
        )
        if n <= 0:
            return 0
        with torch.inference_mode():
            seconds = time_throwaway_prefill(self, n)  # the request is finished after it
        log.info("warmed up: a %d-token prefill in %.2f s", n, seconds)
        return n

    # --- LoRA adapters (worker_svc/lora/adapters.py says what each does) ---

    def load_lora(self, name: str, path: str) -> LoraInfo:
        return self.loras.load(name, path)  # any thread; LoraLoadError where it cannot serve

    def unload_lora(self, name: str) -> bool:
        return self.loras.unload(name)

    def lora_adapters(self) -> list[LoraInfo]:
        return self.loras.adapters()

    def resident_loras(self) -> list[str]:
        return self.loras.resident()

    # --- the step ---

    def reset(self) -> None:
        """Forget every request (the link broke); the KV cache keeps what a leader adopts."""
        self.batch.clear()
        self.structured.clear()

    def held_requests(self) -> list[tuple[str, list[int], int, int]]:
        """Per row of the batch: (request key, block ids, num computed tokens, num tokens)."""
        return self.batch.held_requests()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        self._update_states(so)
        self.kv_cache.swap_out(so.blocks_to_swap_out)
        self.kv_cache.swap_in(so.blocks_to_swap_in)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput({})
        started = time.perf_counter()
        inputs = prepare_inputs(self, so)
        with torch.inference_mode():
            if inputs.graph_step is not None:
                logits = self.decode_graphs.run(*inputs.graph_step)
            else:
                args = (inputs.input_ids, inputs.positions, inputs.logits_index, inputs.meta)
                if inputs.adapters is not None:
                    args += (self.loras.step(inputs.adapters, inputs.num_scheduled),)
                logits = self.model(*args)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            forwarded = time.perf_counter()
            if inputs.drafts is not None:
                return self._sample_and_verify(inputs, logits, started, forwarded)
            tokens, logprobs = self._sample(inputs, logits, inputs.sample_mask)
        done = time.perf_counter()

        self.batch.num_computed[inputs.rows] += inputs.num_scheduled
        self.batch.append_tokens(inputs.rows[inputs.sample_mask], tokens)
        out: dict[str, list[int]] = {}
        k = 0
        for req_id, samples in zip(inputs.req_ids, inputs.sample_mask.tolist(), strict=True):
            if samples:
                out[req_id] = [tokens[k]]
                k += 1
            else:
                out[req_id] = []
        return ModelRunnerOutput(out, logprobs, forwarded - started, done - forwarded)

    def _sample(
        self, inputs: StepInputs, logits: torch.Tensor, mask: np.ndarray
    ) -> tuple[list[int], dict[str, list[TokenLogprobs]] | None]:
        """One token for each packed request in `mask` (logits: their rows, in packed order),
        and the logprobs of those that asked."""
        meta = self.batch.sampling_metadata(inputs.rows[mask])
        sample_ids = self._constrain(inputs, meta, mask) if self.structured.active else None
        sampled = self.sampler(logits, meta)
        tokens = sampled.token_ids.tolist()
        if sample_ids is not None:  # queues the next masks: they fill during the next forward
            self.structured.advance(sample_ids, tokens)
        logprobs = None
        if sampled.logprobs is not None:
            req_ids = [r for r, m in zip(inputs.req_ids, mask.tolist(), strict=True) if m]
            logprobs = {r: [lp] for r, lp in zip(req_ids, sampled.logprobs, strict=True) if lp}
        return tokens, logprobs or None

    def _sample_and_verify(
        self, inputs: StepInputs, logits: torch.Tensor, started: float, forwarded: float
    ) -> ModelRunnerOutput:
        """A step with drafts: a request without them samples its token as in any step; one
        with them keeps what verification accepts (spec_decode.py), 1 to k + 1 tokens."""
        drafts = inputs.drafts
        assert drafts is not None
        plain, spec, plain_pos, spec_pos = [], [], [], []  # packed requests, logits rows
        pos = 0
        for i, (s, d) in enumerate(zip(inputs.sample_mask.tolist(), drafts, strict=True)):
            if not s:
                continue
            rows = range(pos, pos + 1 + len(d))
            (spec if d else plain).append(i)
            (spec_pos if d else plain_pos).extend(rows)
            pos = rows.stop
        kept: dict[int, list[int]] = {}
        logprobs = None
        if plain:
            mask = np.zeros(len(drafts), dtype=bool)
            mask[plain] = True
            tokens, logprobs = self._sample(inputs, logits[plain_pos], mask)
            kept.update((i, [t]) for i, t in zip(plain, tokens, strict=True))
        if spec:
            counts = [1 + len(drafts[i]) for i in spec]
            meta = self.batch.sampling_metadata(np.repeat(inputs.rows[spec], counts))
            verified = spec_decode.verify(
                logits[spec_pos], [drafts[i] for i in spec], meta, self.sampler
            )
            kept.update(zip(spec, verified, strict=True))
        done = time.perf_counter()
        self.batch.num_computed[inputs.rows] += inputs.num_scheduled
        out: dict[str, list[int]] = {}
        for i, req_id in enumerate(inputs.req_ids):
            out[req_id] = tokens = kept.get(i, [])
            if tokens:
                rejected = len(drafts[i]) - (len(tokens) - 1)
                self.batch.keep_verified(int(inputs.rows[i]), tokens, rejected, self.block_size)
        return ModelRunnerOutput(out, logprobs, forwarded - started, done - forwarded)

    def _constrain(self, inputs: StepInputs, meta: SamplingMetadata, mask: np.ndarray) -> list[str]:
        """Put the grammar masks of the constrained requests in `mask` into `meta`; returns the
        ids of the requests in `mask`, in sampling order."""
        sample_ids = [r for r, s in zip(inputs.req_ids, mask.tolist(), strict=True) if s]
        picked = self.structured.masks(sample_ids)
        if picked is not None:
            positions, masks = picked
            meta.mask_rows = torch.tensor(positions, dtype=torch.int64, device=self.device)
            if self.sampler.packed_mask is not None:  # applied from the words themselves
                meta.packed_masks = torch.from_numpy(masks)
            else:
                meta.allowed = token_masks(masks, self._vocab_size, self.device)
        return sample_ids

    def _update_states(self, so: SchedulerOutput) -> None:
        batch, structured = self.batch, self.structured
        self.loras.check_requests(new.lora_name for new in so.new_requests)
        for req_id in so.finished_req_ids:
            batch.remove(req_id)
            structured.remove(req_id)
        self.loras.collect(lambda: {state.lora_name for state in batch.states.values()})
        for req_id in so.preempted_req_ids:
            batch.preempt(req_id)
        for new in so.new_requests:
            batch.add(
                new.request_id,
                new.prompt_token_ids,
                new.output_token_ids,
                new.sampling_params,
                new.block_ids,
                new.num_computed_tokens,
                new.lora_name,
            )
            structured.add(new.request_id, new.sampling_params.structured, new.output_token_ids)
        for cached in so.cached_requests:
            if cached.resumed:
                batch.resume(
                    cached.request_id,
                    cached.new_block_ids,
                    cached.num_computed_tokens,
                    cached.new_token_ids,
                )
                params = batch.states[cached.request_id].params
                structured.add(cached.request_id, params.structured, cached.new_token_ids)
            else:
                batch.append_blocks(cached.request_id, cached.new_block_ids)
                batch.set_num_computed(cached.request_id, cached.num_computed_tokens)
