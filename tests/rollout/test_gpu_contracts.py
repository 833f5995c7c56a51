"""The GPU-only paths of the rollout side, checked by contract on the CPU, with the libraries' own code
wherever it runs here: vLLM's msgpack encoder and update-info dataclass on exactly what the CUDA IPC sender
puts through `collective_rpc`, vLLM's engine arguments and Ray's accelerator manager on the GPUs each engine
and worker is given (on a machine made to report N GPUs), the NCCL receiver's one-weight-at-a-time load,
and the address other nodes dial for the weight group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.integration   # importing vLLM starts a child process (its platform probe)


def _cuda_like_handle(t: torch.Tensor) -> dict[str, tuple]:
    """What `reduce_tensor` returns for a CUDA tensor, field by field (torch/multiprocessing/reductions.py:
    tensor class, size, stride, offset, storage class, dtype, device, IPC handle, storage size and offset,
    requires_grad, ref counter handle and offset, event handle, event sync): classes and a dtype among them."""
    return {"GPU-0000": (type(t), tuple(t.shape), t.stride(), 0, torch.UntypedStorage, t.dtype, 0, b"\x01" * 64,
                         t.numel() * t.element_size(), 0, False, b"ref", 0, b"\x02" * 64, True)}


class _Engine:
    """An engine frontend's `collective_rpc` that encodes every call with vLLM's own msgpack encoder, as
    the client of an engine core in another process does, decodes it as the engine core does, and hands
    `update_weights` to the CPU twin of vLLM's IPC receiver (`CpuIpcWeightTransferEngine`) on a model that
    records what it loads; fails where told."""

    def __init__(self, fail: str | None = None) -> None:
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.encoder, self.decoder, self.fail, self.calls, self.loaded = MsgpackEncoder(), MsgpackDecoder(), fail, [], []
        self.receiver = _cpu_receiver(self.loaded)

    def __call__(self, api: str, method: str, *args, **kwargs):
        assert api == "collective_rpc"
        sent = self.decoder.decode(self.encoder.encode((method, args, kwargs)))   # raises as vLLM's client would
        self.calls.append((method, sent[2].get("kwargs", {})))
        if method == self.fail:
            raise RuntimeError(f"{method} failed in the engine")
        if method == "init_weight_transfer_engine":
            self.receiver.init_transfer_engine(self.receiver.parse_init_info(sent[2]["kwargs"]["init_info"]))
        if method == "update_weights":
            self.receiver.update_weights(sent[2]["kwargs"]["update_info"])
        return [None]


def _cpu_receiver(loaded: list):
    from anytime.rollout.engines.vllm.cpu_ipc import CpuIpcWeightTransferEngine

    class Model(torch.nn.Module):
        def load_weights(self, weights):
            loaded.extend((name, t.clone()) for name, t in weights)

    config = SimpleNamespace(parallel_config=None, model_config=None)
    return CpuIpcWeightTransferEngine(SimpleNamespace(backend="anytime_cpu_ipc"), config, torch.device("cpu"), Model())


def _weights() -> list[tuple[str, torch.Tensor]]:
    return [("model.embed_tokens.weight", torch.randn(8, 4)), ("lm_head.weight", torch.randn(8, 4, dtype=torch.bfloat16)),
            ("model.norm.weight", torch.randn(3))]


def test_vllm_msgpack_refuses_raw_cuda_ipc_handles(monkeypatch):
    """Why handles travel pickled: the handles as vLLM's trainer-side engine sends them cannot cross `collective_rpc`."""
    from vllm.v1.serial_utils import MsgpackEncoder

    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(TypeError, match="not serializable"):
        MsgpackEncoder().encode({"ipc_handles": [_cuda_like_handle(torch.zeros(2))]})


def test_pickled_cuda_handles_decode_as_vllms_update_info_reads_them(monkeypatch):
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from anytime.rollout.engines.vllm.weights import IpcWeightLoader

    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    weights = _weights()
    handles = [_cuda_like_handle(t) for _, t in weights]
    wire = MsgpackDecoder().decode(MsgpackEncoder().encode(IpcWeightLoader.update_info(weights, handles)))
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        IPCWeightTransferUpdateInfo(**wire)   # an engine core started without the variable refuses them
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    info = IPCWeightTransferUpdateInfo(**wire)
    assert info.names == [n for n, _ in weights]
    assert info.dtype_names == ["float32", "bfloat16", "float32"] and info.shapes == [[8, 4], [8, 4], [3]]
    assert info.ipc_handles == handles


def test_the_cpu_twin_receives_exactly_the_weights_sent_through_vllms_own_serializers(monkeypatch):
    """The CPU sender and receiver of the IPC conversation, with vLLM's encoder and decoder between them:
    vLLM's order of calls, and every weight (any dtype) loaded bit for bit from the shared file, which is
    gone once the update finishes."""
    from anytime.rollout.engines.weight_files import weight_file_globs
    from anytime.rollout.engines.vllm.weights import IpcWeightLoader
    import glob
    import os

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # both ends of an engine core of its own
    engine, weights = _Engine(), _weights()
    IpcWeightLoader(engine, torch.device("cpu")).load(weights)
    assert [m for m, _ in engine.calls] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                            "finish_weight_update"]
    assert [n for n, _ in engine.loaded] == [n for n, _ in weights]
    for (_, got), (_, sent) in zip(engine.loaded, weights):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    assert not [f for pattern in weight_file_globs(os.getpid()) for f in glob.glob(pattern)]


def test_a_cpu_handle_from_another_machine_is_refused_by_name():
    from anytime.rollout.engines.vllm.ipc_handles import rebuilt_on_cpu

    with pytest.raises(ValueError, match="IPC handle not found for this machine"):
        rebuilt_on_cpu([{"host-elsewhere": ("/dev/shm/x", 0, 4)}], ["float32"], [[1]])


@pytest.mark.parametrize("reply", [[None], True, None, [True, False]])
def test_typed_utility_replies_decode_only_where_both_ends_carry_the_variable(monkeypatch, reply):
    """Finding 1 of round 6, both directions of the conversation with vLLM's own serializers: an engine
    core started with `weight_transfer_env` sends each utility reply (`collective_rpc`'s `[None]`,
    `wake_up`'s bool) with its type; the client decodes it only with the same variable set (what the engine
    now sets in this process before starting its core); without it vLLM's client raises in its output
    thread and the caller waits forever."""
    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    from anytime.rollout.engines.vllm.process import weight_transfer_env

    env = weight_transfer_env(ipc_transfer=True)
    assert env == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} and weight_transfer_env(ipc_transfer=False) == {}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    wire = MsgpackEncoder().encode(EngineCoreOutputs(utility_output=UtilityOutput(7, result=UtilityResult(reply))))
    assert MsgpackDecoder(EngineCoreOutputs).decode(wire).utility_output.result.result == reply
    for name in env:
        monkeypatch.delenv(name)
    if reply is None:   # an untyped reply decodes anywhere
        assert MsgpackDecoder(EngineCoreOutputs).decode(wire).utility_output.result.result is None
        return
    import msgspec

    with pytest.raises((TypeError, msgspec.ValidationError), match="VLLM_ALLOW_INSECURE_SERIALIZATION must be set"):
        MsgpackDecoder(EngineCoreOutputs).decode(wire)   # in vLLM's client: its output thread dies here


def test_a_failed_ipc_update_ends_the_session_so_the_next_sync_can_start(monkeypatch):
    from anytime.rollout.engines.vllm.weights import IpcWeightLoader

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    engine = _Engine(fail="update_weights")
    loader = IpcWeightLoader(engine, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="update_weights failed"):
        loader.load(_weights())
    assert [m for m, _ in engine.calls][-2:] == ["update_weights", "finish_weight_update"]
    engine.fail = None
    loader.load(_weights())   # a new session starts; init is not repeated
    assert [m for m, _ in engine.calls][-3:] == ["start_weight_update", "update_weights", "finish_weight_update"]
    assert [m for m, _ in engine.calls].count("init_weight_transfer_engine") == 1


def test_ipc_sender_issues_no_collective_on_the_learners_process_group(monkeypatch):
    """In a multi-process learner only the rank that owns the engine sends: a collective there would wait
    for ranks that never enter it (vLLM's sender all-gathers handles over the default group)."""
    import torch.distributed as dist

    from anytime.rollout.engines.vllm.weights import IpcWeightLoader

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    called = []
    for name in ("all_gather_object", "barrier", "broadcast", "all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: called.append(_n))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    IpcWeightLoader(_Engine(), torch.device("cpu")).load(_weights())
    assert called == []


# ---- which GPU each engine and worker is given -----------------------------------------------------

class _Gpus:
    """A machine made to report `count` GPUs to torch: set_device/current_device as CUDA keeps them."""

    def __init__(self, monkeypatch, count: int) -> None:
        self.current = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: setattr(self, "current", int(i)))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)


@pytest.mark.parametrize("local_rank", [0, 3])
def test_learner_rank_r_engine_is_given_gpu_r(monkeypatch, local_rank):
    import torch.distributed as dist
    from vllm.engine.arg_utils import EngineArgs

    from anytime.core.dist import init_from_env
    from anytime.rollout.engines.vllm.process import gpu_kwargs

    _Gpus(monkeypatch, 4)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    init_from_env()   # what every learner rank runs first (inprocess and colocated engines live there)
    kwargs = gpu_kwargs(torch.cuda.current_device(), gpu_memory_utilization=0.5, sleep=True, ipc_transfer=False)
    assert kwargs["device_ids"] == [local_rank]
    # vLLM's own engine arguments turn it into the physical GPU its worker binds (`assigned_physical_gpu_ids`)
    engine_args = SimpleNamespace(device_ids=kwargs["device_ids"], distributed_executor_backend=None)
    assert EngineArgs._resolve_device_ids(engine_args) == [local_rank]


def test_engine_gpu_kwargs_name_the_ipc_backend_only_for_an_engine_of_its_own():
    from anytime.rollout.engines.vllm.process import gpu_kwargs

    own = gpu_kwargs(2, gpu_memory_utilization=0.4, sleep=False, ipc_transfer=True)
    assert own["weight_transfer_config"] == {"backend": "ipc"} and own["device_ids"] == [2]
    assert "weight_transfer_config" not in gpu_kwargs(2, gpu_memory_utilization=0.4, sleep=False, ipc_transfer=False)


def _recipe(*overrides: str):
    from anytime.config import load_recipe

    return load_recipe("recipes/quickstart.yaml", list(overrides))


def _plan(recipe):
    """The recipe's placement plan on this (pretend-GPU) machine, as the trainer makes it."""
    from anytime.config.placement_plan import placement_plan

    return placement_plan(recipe)


@pytest.mark.parametrize("stages,processes,want", [(1, 2, [2, 3]), (2, 1, [2, 3]), (1, 1, [1, 2])])
def test_process_workers_take_the_gpus_after_every_learner_process(monkeypatch, stages, processes, want):
    """Learner processes count pipeline stages (`learner.processes`): stage 1 of a lone replica is GPU 1."""
    from anytime.rollout.workers.processes import ProcessTransport

    _Gpus(monkeypatch, 4)
    extra = ["learner.pipeline.stages=2"] if stages > 1 else []
    rollouts = ProcessTransport.__new__(ProcessTransport)
    rollouts.recipe = _recipe(f"learner.num_processes={processes}", "rollout.placement=processes", *extra)
    rollouts.plan = _plan(rollouts.recipe)
    assert rollouts._gpus(2) == want


def test_process_workers_that_do_not_fit_after_the_learners_are_refused(monkeypatch):
    from anytime.rollout.workers.processes import ProcessTransport

    _Gpus(monkeypatch, 2)
    rollouts = ProcessTransport.__new__(ProcessTransport)
    rollouts.recipe = _recipe("learner.num_processes=2", "rollout.placement=processes")
    rollouts.plan = _plan(rollouts.recipe)
    assert any("rollout.workers" in p for p in rollouts.plan.problems)   # the run's preflight says so first
    with pytest.raises(ValueError, match="rollout.workers"):
        rollouts._gpus(1)


@pytest.mark.parametrize("visible,want", [(None, ["2", "3"]), ("4,5,6,7", ["6", "7"])])
def test_local_ray_cluster_sees_only_the_gpus_after_the_learners(monkeypatch, visible, want):
    """Ray hands its actors GPUs from the ids visible when it starts (its accelerator manager reads
    CUDA_VISIBLE_DEVICES); the learners' GPUs are not among them."""
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

    from anytime.rollout.workers.ray_workers import environment, local_ray_env

    _Gpus(monkeypatch, 4)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    recipe = _recipe("learner.num_processes=2", "rollout.placement=ray", "rollout.workers=2")
    with environment(local_ray_env(recipe, _plan(recipe))):
        assert NvidiaGPUAcceleratorManager.get_current_process_visible_accelerator_ids() == want
    assert NvidiaGPUAcceleratorManager.get_current_process_visible_accelerator_ids() == (
        None if visible is None else visible.split(","))


def test_local_ray_cluster_without_a_free_gpu_is_refused_by_name(monkeypatch):
    from anytime.rollout.workers.ray_workers import local_ray_env

    _Gpus(monkeypatch, 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)   # not under torchrun: the plan's learner count
    recipe = _recipe("learner.num_processes=2", "rollout.placement=ray", "rollout.workers=1")
    with pytest.raises(ValueError, match="rollout.ray_gpus_per_worker"):
        local_ray_env(recipe, _plan(recipe))


@pytest.mark.parametrize("torchrun_value", [None, "2"])
def test_an_engine_started_in_this_process_leaves_the_launchers_variables_as_they_were(monkeypatch, torchrun_value):
    """vLLM's CPU platform sets LOCAL_WORLD_SIZE (to the engine's tensor-parallel size) in the process that
    configures an engine: the block an engine starts in hides torchrun's value from vLLM and gives it back
    after, and a value vLLM set where torchrun set none does not stay (a learner or a test that later reads
    it would count one local process)."""
    import os

    from anytime.rollout.engines.vllm.process import launcher_env_hidden

    if torchrun_value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", torchrun_value)
    with launcher_env_hidden():
        assert "LOCAL_WORLD_SIZE" not in os.environ      # the engine does not take itself for a learner rank
        os.environ["LOCAL_WORLD_SIZE"] = "1"             # what vLLM's CpuPlatform.check_and_update_config does
    assert os.environ.get("LOCAL_WORLD_SIZE") == torchrun_value


def test_weight_group_address_is_the_one_ray_advertises_not_the_hosts_loopback_name(monkeypatch):
    import socket

    import ray.util

    from anytime.rollout.workers.ray_workers import weight_group_host

    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")   # Debian's /etc/hosts entry
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    assert weight_group_host() == "10.1.2.3"


# ---- the NCCL receiver -----------------------------------------------------------------------------

def test_nccl_receiver_holds_one_received_weight_at_a_time():
    from anytime.rollout.engines.vllm.weights import received_one_at_a_time

    layout = [(f"w{i}", (4, 4), "float32") for i in range(5)]
    received, loaded, live_at_load = [], [], []

    def receive(name, shape, dtype):
        received.append(name)
        return torch.full(shape, float(len(received)))

    for name, tensor in received_one_at_a_time(layout, receive):   # the loader: copies, then asks for the next
        live_at_load.append(len(received) - len(loaded))
        loaded.append(name)
    assert loaded == received == [n for n, _, _ in layout]
    assert live_at_load == [1] * len(layout)


def test_nccl_receiver_still_receives_every_weight_when_the_loader_stops_early():
    """The sender broadcasts every weight: a receiver that stops taking them would hang it."""
    import contextlib

    from anytime.rollout.engines.vllm.weights import received_one_at_a_time

    layout = [(f"w{i}", (2,), "float32") for i in range(4)]
    received = []
    with contextlib.closing(received_one_at_a_time(layout, lambda n, s, d: received.append(n) or torch.zeros(s))) as it:
        next(it)   # the loader fails after the first weight
    assert received == [n for n, _, _ in layout]



# ---- the NCCL weight group: a refusal where vLLM disabled it, a timeout where a peer never joins ----------

def test_a_weight_group_whose_nccl_vllm_disabled_is_refused_on_both_ends():
    """vLLM's `PyNcclCommunicator` disables itself silently when libnccl cannot be loaded (as on this CPU
    machine) and its broadcasts then return at once; both members of a real two-member group refuse it."""
    import socket
    import threading

    from vllm.distributed.utils import StatelessProcessGroup

    from anytime.rollout.engines.vllm.weights import nccl_communicator

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    errors: dict[int, str] = {}

    def member(rank: int) -> None:
        group = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=2, store_timeout=60)
        try:
            nccl_communicator(group, "cuda:0")
        except RuntimeError as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert sorted(errors) == [0, 1]
    assert all("disabled" in e and "rollout.weight_sync=object_store" in e for e in errors.values())


def test_a_broadcast_nobody_joins_fails_after_the_timeout_instead_of_waiting_forever():
    import time

    from anytime.rollout.engines.vllm.weights import wait_for

    polls = []
    wait_for(lambda: polls.append(1) or len(polls) >= 3, timeout_s=5, what="receiving", poll_s=0.001)
    assert len(polls) == 3
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="sending the weights over NCCL did not finish within 0.2 s"):
        wait_for(lambda: False, timeout_s=0.2, what="sending the weights over NCCL", poll_s=0.01)
    assert time.monotonic() - start < 2


def test_an_engine_started_in_this_process_leaves_its_torch_threads_as_they_were(monkeypatch):
    """vLLM's `Worker.load_model` sets torch's threads to 1 (`set_torch_threads_for_runtime`), which an
    in-process GPU engine would impose on the learner beside it; the engine's start keeps them."""
    from vllm.utils.torch_utils import set_torch_threads_for_runtime

    from anytime.rollout.engines.vllm.process import torch_threads_kept

    threads = {"n": 2}
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["n"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.update(n=n))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with torch_threads_kept():
        set_torch_threads_for_runtime()   # what vLLM's worker runs when it has loaded the model
        assert threads["n"] == 1
    assert threads["n"] == 2
