"""The package in this process, in a group of one: module attributes, options, tensors
(zero-copy, dtypes, NumPy), reports, errors raised by bad input, files and timeouts, stubs and
help text."""

import ast
import concurrent.futures
import gc
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import pulseloco
from group_helpers import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def group_of_one(monkeypatch):
    """No launcher's variables: every Synchronizer here forms a group of one."""
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK") or \
                name.startswith(("PULSELOCO_", "OMPI_", "PMIX_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PULSELOCO_LOG_LEVEL", "warn")


def linear(dtype=torch.float32):
    torch.manual_seed(3)
    return torch.nn.Linear(6, 4).to(dtype)


def test_version_is_the_projects_and_features_describe_the_build():
    project = re.search(r"project\(pulseloco\s+VERSION\s+([0-9.]+)",
                        (REPO / "CMakeLists.txt").read_text()).group(1)
    assert pulseloco.__version__ == project
    features = pulseloco.features()
    assert features["version"] == project
    assert "tcp" in features["transports"]
    assert isinstance(features["cuda"], bool)
    assert (features["tls"], features["elastic"], features["libtorch"]) == (True, True, False)


def test_extension_does_not_link_libtorch():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf is not installed")
    output = subprocess.run([readelf, "-d", pulseloco._pulseloco.__file__], check=True,
                            capture_output=True, text=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", output)
    assert needed, output
    assert not [n for n in needed if re.match(r"lib(torch|c10)", n)], needed


def test_tensors_are_used_in_place_fp32_and_bf16():
    model = linear()
    half = linear(torch.bfloat16)
    parameters = {"w": model.weight, "b": model.bias, "hw": half.weight}
    with pulseloco.Synchronizer(parameters, inner_steps=1) as sync:
        table = sync.tensor_table()
        assert [t.name for t in table] == ["w", "b", "hw"]
        assert [t.data_ptr for t in table] == [p.data_ptr() for p in parameters.values()]
        assert [t.dtype for t in table] == ["float32", "float32", "bfloat16"]
        assert [t.numel for t in table] == [24, 4, 24]
        assert {t.device for t in table} == {"cpu"}
        assert sync.parameter_count == 52
        with torch.no_grad():
            model.weight -= 0.25
            half.weight += 0.5
        report = sync.after_optimizer_step()
        assert report is not None and report.window == 0
        # The window wrote the new weights into the tensors themselves.
        assert np.array_equal(model.weight.detach().numpy().ravel(), sync.global_weights(0))
        rounded = torch.from_numpy(sync.global_weights(2)).to(torch.bfloat16)
        assert torch.equal(half.weight.detach().ravel(), rounded)


def test_numpy_parameters_and_tensors_without_names():
    arrays = [np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
              np.ones(5, dtype=np.float32)]
    with pulseloco.Synchronizer(arrays, inner_steps=2) as sync:
        assert [t.name for t in sync.tensor_table()] == ["0", "1"]
        assert [t.data_ptr for t in sync.tensor_table()] == [a.ctypes.data for a in arrays]
        arrays[0] += 0.5
        assert sync.after_optimizer_step() is None
        assert sync.next_step_runs_window
        report = sync.after_optimizer_step()
        assert report.window == 0 and sync.committed_windows == 1
        assert np.array_equal(arrays[0].ravel(), sync.global_weights(0))
        assert sync.momentum(0).dtype == np.float32 and sync.residual(1).shape == (5,)


def test_windows_release_the_gil():
    # Two ranks on two threads of this process can only form a group and run windows together
    # when neither holds the GIL while it waits for the other.
    port = free_port()
    arrays = [np.full(32, r, np.float32) for r in range(2)]

    def rank(r):
        group = dict(rendezvous="env", rank=r, world_size=2, master_addr="127.0.0.1",
                     master_port=port, connect_timeout=60.0)
        with pulseloco.Synchronizer([arrays[r]], inner_steps=1, group=group, timeout=60.0,
                                    threads=1) as sync:
            arrays[r] += 0.5 * (r + 1)
            return [sync.after_optimizer_step().digest for _ in range(3)]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        digests = list(pool.map(rank, range(2)))
    assert digests[0] == digests[1]
    assert np.array_equal(arrays[0], arrays[1]), "both ranks hold the same weights"


def collective_threads():
    """Native ids of this process's threads named as a synchroniser's collective thread."""
    ids = []
    for task in os.listdir("/proc/self/task"):
        try:
            name = pathlib.Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        if name == "pl-collective":
            ids.append(int(task))
    return ids


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_collective_calls_run_on_one_thread_per_synchronizer_until_it_closes():
    # ddp averages the gradients at every optimizer step: every call runs on the same thread,
    # which lives as long as the synchroniser is open, and none is left once it is closed.
    # A synchroniser of an earlier test that only a reference cycle keeps alive (an exception's
    # traceback) still has its thread until the cycle is collected: collect now, and count only
    # threads that were not there before. A thread the collective thread starts (the engine's
    # pool, the transport's I/O) bears its name from its start until the collective thread names
    # it, a moment a sample may catch: the collective thread is the one new thread still so named
    # at the end (waited for, bounded, in case a thread started elsewhere names itself only once
    # it runs), and every sample must have seen it.
    gc.collect()
    before = set(collective_threads())
    model = linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples = []
    with pulseloco.Synchronizer(model.named_parameters(), mode="ddp", inner_steps=2) as sync:
        for step in range(6):
            optimizer.zero_grad()
            model(torch.ones(2, 6)).sum().backward()
            sync.before_optimizer_step()
            samples.append(set(collective_threads()) - before)
            optimizer.step()
            report = sync.after_optimizer_step()
            assert (report is None) == (step % 2 == 0)
            samples.append(set(collective_threads()) - before)
        persistent = set(collective_threads()) - before
        give_up = time.monotonic() + 60
        while len(persistent) > 1 and time.monotonic() < give_up:
            time.sleep(0.001)  # lets a thread that has not run yet run and name itself
            persistent = set(collective_threads()) - before
        assert len(persistent) == 1, (persistent, samples)
        assert all(persistent <= sample for sample in samples), (persistent, samples)
    assert not persistent & set(collective_threads())


def test_every_engine_option_reaches_the_engine(tmp_path):
    options = dict(chunk_elements=4096, bucket_elements=8192, threads=1, timeout=12.5,
                   allgather="ring", pipeline_chunk_bytes=65536, bf16_delta="authors",
                   verify_digests=False, trace_dir=str(tmp_path), state_location="host",
                   publish_dir=str(tmp_path / "versions"), publish_every=2, anchor_every=5,
                   encoding="plain_i32_f32", zstd_level=3, index_coding="bitpack")
    with pulseloco.Synchronizer([np.zeros(8, np.float32)], mode="diloco", inner_steps=3,
                                outer_lr=0.5, outer_momentum=0.25, **options) as sync:
        got = sync.options
        assert sync.state_location == "host"
    assert got["mode"] == "diloco" and got["steps_per_window"] == 3
    assert (got["outer_lr"], got["outer_momentum"]) == (0.5, 0.25)
    assert got["timeout_ms"] == 12500 and got["codec_level"] == 3
    for key in ("chunk_elements", "bucket_elements", "threads", "allgather",
                "pipeline_chunk_bytes", "bf16_delta", "verify_digests", "trace_dir",
                "publish_dir", "publish_every", "anchor_every", "encoding"):
        assert got[key] == options[key], key


@pytest.mark.parametrize("overlap", ["blocking", "delayed", "eager"])
def test_overlap_reaches_the_engine_and_the_reports(overlap):
    with pulseloco.Synchronizer([np.ones(16, np.float32)], inner_steps=1,
                                overlap=overlap) as sync:
        assert sync.options["overlap"] == overlap
        assert not sync.window_in_flight
        reports = [sync.after_optimizer_step() for _ in range(2)]
        assert sync.window_in_flight == (overlap != "blocking")
        completed = sync.complete_in_flight()
        assert not sync.window_in_flight and sync.complete_in_flight() is None
    assert [r.overlap for r in reports] == [overlap, overlap]
    if overlap == "blocking":
        assert [r.applied_window for r in reports] == [0, 1] and completed is None
    else:
        assert [r.applied_window for r in reports] == [None, 0]
        assert (completed.window, completed.applied_window) == (1, 1)
        assert completed.overlap == overlap
    assert sync.committed_windows == 2


def test_every_group_option_is_accepted():
    group = dict(backend="tcp", rendezvous="peers", rank=0, world_size=1,
                 master_addr="127.0.0.1", master_port=1, external_rendezvous_server=False,
                 peers=[f"127.0.0.1:{free_port()}"], group_key="g", run_id="run",
                 advertise_addr="127.0.0.1", socket_ifname="", connect_timeout=5.0,
                 nccl_bootstrap="tcp", listen_addr="127.0.0.1", listen_port=0,
                 connections_per_peer=3, stripe_threshold_bytes=1 << 20,
                 stripe_chunk_bytes=1 << 21, tcp_nodelay=False, socket_send_buffer_bytes=0,
                 socket_receive_buffer_bytes=0, keepalive=True, keepalive_idle_s=30,
                 keepalive_interval_s=5, keepalive_count=3, io_timeout=0.0,
                 max_unexpected_bytes=1 << 24, payload_checksums=False, io_threads=2,
                 busy_poll=0.0001, secret="a secret", allow_insecure=False,
                 link_security="hmac", same_host_plaintext=False, tls_cert="", tls_key="",
                 tls_ca="",
                 mpi_part_bytes=1 << 20, cuda_device=-1, local_rank=-1)
    with pulseloco.Synchronizer([np.zeros(4, np.float32)], group=group) as sync:
        assert (sync.rank, sync.world_size) == (0, 1)
        assert sync.run_window().replicas_identical


@pytest.mark.parametrize("kwargs, needle", [
    (dict(chunk_size=5), "chunk_size"),
    (dict(threads="two"), "threads"),
    (dict(allgather="tree"), "tree"),
    (dict(mode="fast"), "fast"),
    (dict(inner_steps=0), "inner_steps: 0 is not in [1, "),
    (dict(inner_steps="8"), "inner_steps: expected an int, got a str"),
    (dict(inner_steps=8.0), "inner_steps: expected an int, got a float"),
    (dict(mode=None), "mode: expected a str"),
    (dict(outer_lr=None), "outer_lr: expected a float"),
    (dict(outer_momentum="0.9"), "outer_momentum: expected a float"),
    (dict(outer_lr=10**400), "outer_lr: an int too large for a float"),
    (dict(timeout=10**400), "option 'timeout': an int too large for a float"),
    (dict(group={"io_timeout": 10**400}), "option 'io_timeout': an int too large for a float"),
    (dict(group={"exchange_bucket": 5}), "'exchange_bucket': expected an s3://bucket/prefix"),
    (dict(group={"exchange_bucket": ""}), "'exchange_bucket': expected an s3://bucket/prefix"),
    (dict(group={"exchange_bucket": "s3://b/p", 1: 2}), "a str key"),
    (dict(group={"ranks": 2}), "ranks"),
    (dict(group={"rank": "0"}), "rank"),
    (dict(group={"backend": "carrier-pigeon"}), "carrier-pigeon"),
    (dict(index_coding="zigzag"), "zigzag"),
    (dict(overlap="sometimes"), "sometimes"),
    (dict(overlap=True), "overlap"),
    (dict(mode="diloco", overlap="delayed"), "overlap"),
    (dict(group={"exchange_bucket": "http://example/b"}), "http://example/b"),
    (dict(group={"exchange_bucket": "s3://b/p", "rank": 0, "world_size": 1, "run_id": "r",
                 "secret": ""}), "PULSELOCO_SECRET"),
    (dict(group={"exchange_bucket": "s3://b/p"}, elastic={"coordinator": "127.0.0.1:1"}),
     "elastic membership is not supported through a bucket"),
])
def test_bad_options_raise_invalid_argument_naming_them(kwargs, needle):
    with pytest.raises(pulseloco.InvalidArgument) as caught:
        pulseloco.Synchronizer([np.zeros(4, np.float32)], **kwargs)
    assert needle in str(caught.value)
    assert isinstance(caught.value, ValueError) and caught.value.kind == "invalid_argument"


def test_bad_call_arguments_raise_invalid_argument_naming_them(tmp_path):
    with pulseloco.Synchronizer([np.zeros(4, np.float32)]) as sync:
        for call, needle in [
                (lambda: sync.save_checkpoint(tmp_path, keep=-1), "keep: -1 is not in [1, "),
                (lambda: sync.save_checkpoint(tmp_path, keep="2"), "keep: expected an int"),
                (lambda: sync.save_checkpoint(tmp_path, files={1: b"x"}),
                 "files: a file name must be a str"),
                (lambda: sync.save_checkpoint(None), "root: expected a path, got a NoneType"),
                (lambda: sync.save_checkpoint(tmp_path, files="x"),
                 "files: expected a dict name -> bytes, got a str"),
                (lambda: sync.save_checkpoint(tmp_path, optimizer=object()),
                 "optimizer: expected a torch optimizer, got a object"),
                (lambda: sync.load_checkpoint(123), "path: expected a path, got a int"),
                (lambda: sync.load_checkpoint(tmp_path, optimizer=object()),
                 "optimizer: expected a torch optimizer, got a object"),
                (lambda: sync.save_global_weights(None), "file: expected a path, got a NoneType"),
                (lambda: sync.global_weights(-1), "i: -1 is not in [0, "),
                (lambda: sync.momentum("0"), "i: expected an int"),
                (lambda: sync.residual(1), "tensor 1 does not exist")]:
            with pytest.raises(pulseloco.InvalidArgument) as caught:
                call()
            assert needle in str(caught.value)
        assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("tensor, needle", [
    (torch.zeros(4, 6)[:, ::2], "not contiguous"),
    (torch.zeros(4, dtype=torch.int64), "neither float32 nor bfloat16"),
    (np.zeros(4, np.float64), "neither float32 nor bfloat16"),
    ("weights", "neither a tensor with __dlpack__"),
    (np.frombuffer(bytes(16), np.float32), "not read-only"),
])
def test_bad_tensors_raise_invalid_argument_naming_them(tensor, needle):
    with pytest.raises(pulseloco.InvalidArgument) as caught:
        pulseloco.Synchronizer({"ok": torch.zeros(3), "bad": tensor})
    assert needle in str(caught.value)
    assert caught.value.tensor == "bad"


@pytest.mark.parametrize("parameters", [None, 5, torch.nn.Linear(2, 2)])
def test_parameters_that_are_no_collection_of_tensors_are_named(parameters):
    with pytest.raises(pulseloco.InvalidArgument) as caught:
        pulseloco.Synchronizer(parameters)
    assert (f"parameters: expected named_parameters(), a dict name -> tensor or tensors; got a "
            f"{type(parameters).__name__}") in str(caught.value)


def test_ddp_without_gradients_names_the_parameter():
    model = linear()
    with pulseloco.Synchronizer(model.named_parameters(), mode="ddp") as sync:
        with pytest.raises(pulseloco.InvalidArgument) as caught:
            sync.before_optimizer_step()
        assert caught.value.tensor == "weight"


def test_report_is_typed_and_has_a_dict_and_a_summary():
    with pulseloco.Synchronizer([np.ones(16, np.float32)], inner_steps=1) as sync:
        report = sync.after_optimizer_step()
    as_dict = report.to_dict()
    # The dict is the JSON the C++ library writes: a few keys differ from the attributes.
    renamed = {"entries": "entries_sent", "digests": "rank_digests"}
    for name, value in as_dict.items():
        if name == "seconds":
            assert value == report.seconds.to_dict()
        elif name == "patch_anchor":
            assert value == (report.patch_anchor_bytes > 0)
        else:
            assert getattr(report, renamed.get(name, name)) == value, name
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert {"window", "mode", "density", "payload_bytes", "digest", "digests",
            "replicas_identical", "diloco_bytes", "ddp_bytes"} <= set(as_dict)
    assert re.fullmatch("[0-9a-f]{16}", as_dict["digest"]) and as_dict["digests"] == [
        as_dict["digest"]]
    assert f"digest {report.digest}" in report.summary()
    assert (report.overlap, report.applied_window, report.seconds.exchange_in_flight) == \
        ("blocking", 0, 0.0)
    assert {"overlap", "applied_window"} <= set(as_dict)
    assert "exchange_in_flight" in as_dict["seconds"]
    assert report.summary().startswith("window 0 pulse")
    assert repr(report).startswith("WindowReport(window=0, mode='pulse'")
    assert report.digest == sync.digest == report.rank_digests[0]


def test_on_report_receives_every_report_returned():
    received = []
    with pulseloco.Synchronizer([np.ones(16, np.float32)], inner_steps=2,
                                on_report=received.append) as sync:
        returned = [sync.after_optimizer_step() for _ in range(4)]
        returned.append(sync.run_window())
        assert sync.complete_in_flight() is None  # blocking: nothing in flight, nothing delivered
    reports = [r for r in returned if r is not None]
    assert [r.window for r in received] == [0, 1, 2]
    assert [r.to_dict() for r in received] == [r.to_dict() for r in reports]


def test_on_report_must_be_callable():
    with pytest.raises(pulseloco.InvalidArgument, match="on_report"):
        pulseloco.Synchronizer([np.ones(4, np.float32)], on_report="reports.jsonl")


def test_loading_a_missing_checkpoint_is_an_io_error(tmp_path):
    with pulseloco.Synchronizer([np.zeros(4, np.float32)]) as sync:
        with pytest.raises(pulseloco.IoError) as caught:
            sync.load_checkpoint(tmp_path / "nowhere")
    assert isinstance(caught.value, OSError) and caught.value.kind == "io"
    assert caught.value.rank == 0


def test_a_damaged_checkpoint_is_a_protocol_error(tmp_path):
    weights = np.arange(64, dtype=np.float32)
    with pulseloco.Synchronizer([weights], inner_steps=1) as sync:
        sync.after_optimizer_step()
        path = sync.save_checkpoint(tmp_path, files={"notes.txt": b"hello"})
        assert path.parent == tmp_path and path.is_dir()
        loaded = sync.load_checkpoint(tmp_path)
        assert (loaded.dir, loaded.window, loaded.files) == (path, 1, {"notes.txt": b"hello"})
        assert (loaded.next_window, loaded.next_step) == (1, 1)
        damaged = path / "global.safetensors"
        data = bytearray(damaged.read_bytes())
        data[-5] ^= 0x40
        damaged.write_bytes(bytes(data))
        with pytest.raises(pulseloco.ProtocolError) as caught:
            sync.load_checkpoint(path)
    assert "global.safetensors" in str(caught.value)


class SameText(str):
    """A name that equals only itself: a dict holds two of them with the same text, which reach
    the engine as one name given twice (a plain dict holds each name once)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@pytest.mark.parametrize("files, needle", [
    ({"a/b": b"x"}, "checkpoint file name 'a/b' must be letters, digits, '.', '_' and '-'"),
    ({"": b"x"}, "checkpoint file name '' must be letters, digits, '.', '_' and '-'"),
    ({"safetensors": b"x"}, "checkpoint file name 'safetensors' must be letters, digits, '.', "
                            "'_' and '-' (not 'safetensors')"),
    ({SameText("notes.txt"): b"1", SameText("notes.txt"): b"2"},
     "checkpoint file name 'notes.txt' is given twice"),
])
def test_bad_checkpoint_file_names_are_refused_and_nothing_is_written(tmp_path, files, needle):
    root = tmp_path / "ckpt"
    with pulseloco.Synchronizer([np.zeros(4, np.float32)]) as sync:
        with pytest.raises(pulseloco.InvalidArgument) as caught:
            sync.save_checkpoint(root, files=files)
    assert needle in str(caught.value)
    assert not list(root.glob("window-*"))


def test_a_file_named_like_the_optimizers_is_refused_with_optimizer(tmp_path):
    model = linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pulseloco.Synchronizer(model.named_parameters()) as sync:
        with pytest.raises(pulseloco.InvalidArgument) as caught:
            sync.save_checkpoint(tmp_path, optimizer=optimizer, files={"optimizer.pt": b"mine"})
    assert "files holds 'optimizer.pt', the file optimizer= writes" in str(caught.value)
    assert not list(tmp_path.glob("window-*"))


def test_loading_with_optimizer_a_checkpoint_saved_without_it_changes_nothing(tmp_path):
    model = linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pulseloco.Synchronizer(model.named_parameters(), inner_steps=1) as sync:
        saved = sync.save_checkpoint(tmp_path)  # without optimizer=
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.25)
        sync.after_optimizer_step()
        weights = [parameter.detach().clone() for parameter in model.parameters()]
        committed = sync.committed_windows
        with pytest.raises(pulseloco.InvalidArgument) as caught:
            sync.load_checkpoint(tmp_path, optimizer=optimizer)
        assert f"{saved} holds no file 'optimizer.pt' of rank 0" in str(caught.value)
        assert sync.committed_windows == committed == 1
        for parameter, before in zip(model.parameters(), weights):
            assert torch.equal(parameter.detach(), before)


def test_save_global_weights_writes_the_global_weights_as_safetensors(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    model = linear()
    with pulseloco.Synchronizer(model.named_parameters(), inner_steps=1) as sync:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.25)  # a window that moves θ_g away from the start
        sync.after_optimizer_step()
        file = tmp_path / "made" / "global.safetensors"  # its directory is created
        sync.save_global_weights(file)
        expected = {f"global.{info.name}": sync.global_weights(i)
                    for i, info in enumerate(sync.tensor_table())}
        committed = sync.committed_windows
    with safetensors.safe_open(str(file), framework="np") as saved:
        assert saved.metadata()["format"] == "pulseloco-global-weights"
        assert saved.metadata()["window"] == str(committed) == "1"
        assert sorted(saved.keys()) == sorted(expected) == ["global.bias", "global.weight"]
        for name, weights in expected.items():
            tensor = saved.get_tensor(name)
            assert tensor.dtype == np.float32
            assert tensor.shape == tuple(model.get_parameter(name.removeprefix("global.")).shape)
            assert np.array_equal(tensor.reshape(-1), weights.reshape(-1)), name
    assert not np.array_equal(expected["global.weight"].reshape(-1),
                              linear().weight.detach().numpy().reshape(-1))


def test_a_rank_that_never_comes_is_a_timeout():
    group = dict(rendezvous="env", rank=0, world_size=2, master_addr="127.0.0.1",
                 master_port=free_port(), connect_timeout=1.0)
    with pytest.raises(pulseloco.TimeoutError) as caught:
        pulseloco.Synchronizer([np.zeros(4, np.float32)], group=group)
    assert isinstance(caught.value, TimeoutError) and caught.value.kind == "timeout"


def test_help_documents_every_public_method():
    text = io.StringIO()
    sys.stdout, saved = text, sys.stdout
    try:
        help(pulseloco.Synchronizer)
    finally:
        sys.stdout = saved
    assert "named_parameters()" in text.getvalue()
    for name in dir(pulseloco.Synchronizer):
        if not name.startswith("_"):
            assert getattr(pulseloco.Synchronizer, name).__doc__, name
    for name in ("WindowReport", "TensorInfo", "Error", "InvalidArgument", "features"):
        assert getattr(pulseloco, name).__doc__, name


def test_stubs_parse_and_match_the_extension():
    package = pathlib.Path(pulseloco.__file__).parent
    stubs = list(package.glob("*.pyi"))
    assert stubs and (package / "py.typed").exists()
    for stub in stubs:
        ast.parse(stub.read_text(), str(stub))
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "python_stubs"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_cuda_stream_is_ignored_with_host_state():
    # The Synchronizer hands torch's current stream to the engine only for CUDA tensors; the
    # binding takes any stream, and host state ignores it.
    weights = np.linspace(-1, 1, 1024, dtype=np.float32)
    with pulseloco.Synchronizer([weights], inner_steps=1) as sync:
        assert sync._cuda_device is None
        sync._engine.set_cuda_stream(0)
        sync._engine.set_cuda_stream(0x7F00DEAD)
        report = sync.after_optimizer_step()
    assert report is not None and report.state_location == "host"


def test_publishing_reports_each_version(tmp_path):
    weights = np.linspace(-1, 1, 4096, dtype=np.float32)
    with pulseloco.Synchronizer([weights], inner_steps=1, publish_dir=str(tmp_path),
                                anchor_every=2) as sync:
        reports = []
        for step in range(3):
            weights[::7] += np.float32(0.05 * (step + 1))  # a seventh of the weights move
            reports.append(sync.after_optimizer_step())
    assert [r.published_version for r in reports] == [1, 2, 3]
    assert [r.patch_anchor_bytes > 0 for r in reports] == [True, False, True]
    assert reports[0].patch_delta_bytes == 0 and reports[1].patch_delta_bytes > 0
    assert 0 < reports[1].patch_changed < 4096
    assert reports[1].patch_density == reports[1].patch_changed / 4096
    assert all(r.publish_error == "" for r in reports)
    assert "published v2" in reports[1].summary()
    assert (tmp_path / "manifest.json").exists()


def documented_report_fields():
    """The field names in the first column of docs/operations.md's per-window report table, and
    that table's `seconds` row."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = text.split("## The per-window report", 1)[1].split("\n## ", 1)[0]
    fields, seconds_row = [], ""
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first, meaning = line.split("|")[1:3]
        names = re.findall(r"`([^`]+)`", first)
        fields += names
        if names == ["seconds"]:
            seconds_row = meaning
    return fields, seconds_row


def test_the_documented_report_table_lists_the_keys_of_to_dict():
    with pulseloco.Synchronizer([np.ones(16, np.float32)], inner_steps=1) as sync:
        report = sync.after_optimizer_step()
    fields, seconds_row = documented_report_fields()
    assert len(fields) == len(set(fields)), f"a field is documented twice: {sorted(fields)}"
    keys = set(report.to_dict())
    assert set(fields) == keys, (f"documented only: {sorted(set(fields) - keys)}; "
                                 f"in to_dict() only: {sorted(keys - set(fields))}")
    for phase in report.seconds.to_dict():
        assert re.search(rf"\b{phase}\b", seconds_row), f"seconds.{phase} is not documented"


def test_a_new_run_refuses_another_runs_versions_unless_publish_continue(tmp_path):
    def run(steps, **options):
        weights = np.linspace(-1, 1, 4096, dtype=np.float32)
        with pulseloco.Synchronizer([weights], inner_steps=1, publish_dir=str(tmp_path),
                                    **options) as sync:
            reports = []
            for step in range(steps):
                weights[::7] += np.float32(0.05 * (step + 1))
                reports.append(sync.after_optimizer_step())
        return reports

    assert [r.published_version for r in run(2)] == [1, 2]
    refused = run(3)
    assert [r.published_version for r in refused] == [None, None, None]
    assert all("already holds versions 1 to 2" in r.publish_error for r in refused)
    assert "publish_continue" in refused[0].publish_error
    assert [r.published_version for r in run(3, publish_continue=True)] == [None, None, 3]


def test_bad_worker_ports_raise_invalid_argument_naming_them(monkeypatch):
    from pulseloco import _worker
    layout = _worker.WorkerLayout(2, 1, 0, 0)
    monkeypatch.delenv("PULSELOCO_WORKER_PORTS", raising=False)
    monkeypatch.setenv("MASTER_PORT", "abc")
    for worker, needle in [
            ({"ranks_per_worker": 2}, "MASTER_PORT 'abc' is not a port number"),
            ({"ranks_per_worker": 2, "master_ports": ["a", "b"]},
             "master_ports must be a list of ints"),
            ({"ranks_per_worker": 2, "master_ports": 5}, "master_ports must be a list of ints"),
            ({"ranks_per_worker": 2, "master_ports": [0, 29501]},
             "rendezvous port 0 is not in [1, 65535]")]:
        with pytest.raises(pulseloco.InvalidArgument) as caught:
            _worker.group_overrides(layout, _worker.parse_worker(worker), None)
        assert needle in str(caught.value)
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _worker.group_overrides(layout, _worker.parse_worker(2), None)["master_port"] == 29501
    monkeypatch.setenv("PULSELOCO_RANKS_PER_WORKER", "0")
    with pytest.raises(pulseloco.InvalidArgument, match="PULSELOCO_RANKS_PER_WORKER: '0'"):
        _worker.from_environment()
