"""The vLLM rollout engine on `AsyncLLM` (`rollout.vllm_frontend: async`), vLLM's online frontend.

`AsyncLLM` runs the engine core in a process of its own and schedules it by itself: we no longer step
it. An event loop in a thread of ours holds the `AsyncLLM` client; every sample is a request whose
final output a task awaits, and a finished thinking trace adds its summary requests at once, as the
stepped frontend does. In flight, the calling thread polls the weight source while the engine runs and
swaps through vLLM's RL interface: `pause_generation(mode="keep", clear_cache=False)`, the stepped
frontend's load into an engine of its own (a /dev/shm file on the CPU, CUDA IPC on a GPU),
`update_weight_version`, `resume_generation()`. vLLM stops
its scheduler between two engine steps, so a swap never lands inside one, whatever the scheduling.
Requests and swaps take one lock in turn, so a request's cache salt always names the weights it is
scheduled under (the salt is the version current when the request enters; docs/async.md).
Everything else (seeds, prefix caching, streamed summaries, LoRA, sleep/wake, NCCL) is `VLLMEngine`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from anytime.rollout.engines.engine import Completion, EngineError
from anytime.rollout.engines.streaming import Request
from anytime.rollout.engines.vllm.engine import VLLMEngine

_POLL_S = 0.005   # how often the calling thread looks for in-flight weights while the engine runs


class AsyncVLLMEngine(VLLMEngine):
    """`VLLMEngine` on vLLM's `AsyncLLM` (always with its engine core in a process of its own)."""

    frontend_owns_process = True

    def _start(self, kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="anytime-vllm-async", daemon=True)
        self._thread.start()
        self._entry = asyncio.Lock()   # requests entering vs a swap (see the module docstring)

        async def create() -> Any:   # inside the loop: AsyncLLM binds its output handler to it
            return AsyncLLM.from_engine_args(AsyncEngineArgs(disable_log_stats=True, **kwargs))

        try:
            return self._call(create())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the engine's loop and wait for it (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _api(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._call(getattr(self._llm, method)(*args, **kwargs))

    def _lora_api(self, method: str, *args: Any) -> Any:
        return self._api(method, *args)

    def _shutdown(self, llm: Any) -> None:
        try:
            self._call(self._shutdown_in_loop(llm))
        finally:
            self._stop_loop()

    @staticmethod
    async def _shutdown_in_loop(llm: Any) -> None:
        llm.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    # ---- generation ----------------------------------------------------------------------------
    def _serve(self, requests: Sequence[Request],
               finished: Callable[[Request, int, Completion], Sequence[Request]]) -> None:
        """`VLLMEngine._serve`'s contract on `AsyncLLM`: the loop serves, this thread swaps weights."""
        self.poll_weights()   # in flight: prefill with the newest weights
        done = threading.Event()
        future = asyncio.run_coroutine_threadsafe(self._serve_async(requests, finished, done), self._loop)
        try:
            while True:
                try:
                    return future.result(timeout=_POLL_S if self.weight_source is not None else None)
                except concurrent.futures.TimeoutError:
                    self.poll_weights()
        except BaseException:
            future.cancel()        # its requests are aborted before `done` is set
            done.wait(timeout=60)
            raise

    async def _serve_async(self, requests: Sequence[Request],
                           finished: Callable[[Request, int, Completion], Sequence[Request]],
                           done: threading.Event) -> None:
        tasks: set[asyncio.Task[Any]] = set()
        stamped = self.weight_source is not None

        def add(batch: Sequence[Request]) -> None:
            for r in batch:
                for a in range(r.params.n):
                    tasks.add(asyncio.ensure_future(self._sample(r, a)))

        try:
            add(requests)
            while tasks:
                ended, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                tasks.difference_update(ended)
                for task in ended:
                    request, sample, output = task.result()
                    add(finished(request, sample, self._completion(output, stamped)))
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*tasks, return_exceptions=True)
            done.set()

    async def _sample(self, r: Request, sample: int) -> tuple[Request, int, Any]:
        """One sample to its end: enter under the lock (so its salt names its weights), await the output."""
        from vllm.inputs import TokensPrompt

        rid = f"anytime-{next(self._request_ids)}"
        params = self._sampling_params(r.params, None if r.seed is None else r.seed + sample)
        try:
            async with self._entry:
                collector = await self._llm.add_request(
                    rid, TokensPrompt(prompt_token_ids=r.prompt, cache_salt=self._cache_salt()), params,
                    lora_request=self._lora)
        except Exception as e:
            raise EngineError(f"vLLM refused a request: {type(e).__name__}: {e}") from e
        try:
            while True:
                output = collector.get_nowait() or await collector.get()
                if output.finished:
                    return r, sample, output
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._llm.abort(rid)
            raise
        except Exception as e:
            raise EngineError(f"vLLM generation failed: {type(e).__name__}: {e}") from e
        finally:
            collector.close()

    # ---- weights ----------------------------------------------------------------------------------
    # An in-flight swap (`VLLMEngine._swap_weights`) runs here while the engine core keeps going: the
    # pause takes the entry lock, so no request enters until the resume, and lands between two steps.
    def _pause(self) -> None:
        self._call(self._pause_async())

    def _resume(self) -> None:
        self._call(self._resume_async())

    async def _pause_async(self) -> None:
        await self._entry.acquire()
        try:
            await self._llm.pause_generation(mode="keep", clear_cache=False)   # requests and their KV kept
        except BaseException:
            self._entry.release()
            raise

    async def _resume_async(self) -> None:
        try:
            await self._llm.resume_generation()
        finally:
            self._entry.release()
