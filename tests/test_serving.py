"""lade-export triton: the repository it writes, the request contract, and the real
``tritonserver`` (from the nvidia-pytriton wheel) streaming stories260K and SmolLM2,
checked token for token against the in-process API.

The server tests need the ``serve`` extra (tritonclient[grpc]) and
``pip install --no-deps nvidia-pytriton==0.7.0``; .ci/run installs both, and under CI a
missing one fails the test instead of skipping it.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from lade_export.errors import ArtifactError, BackendUnavailableError, GenerationError, ProfileError, ServingError
from lade_export.profile import GREEDY, resolve_profile
from lade_export.runtime import Chunk, GenerationStats
from lade_export.sampling import SamplingParams
from lade_export.serving import protocol
from lade_export.serving.repository import MARKER, render_config, write_model_repository

from .conftest import mt_bench_prompts

ROOT = Path(__file__).resolve().parent.parent
SERVING_DOC = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")


def _require(module: str):
    """Import an optional serving dependency: skip without it, but fail under CI."""
    try:
        return importlib.import_module(module)
    except ImportError:
        message = f"{module} is not installed (pip install -e '.[serve]'; pip install --no-deps nvidia-pytriton==0.7.0)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _require_triton():
    _require("tritonclient.grpc.aio")
    from lade_export.serving.local import find_triton

    try:
        return find_triton()
    except BackendUnavailableError as err:
        if os.environ.get("CI"):
            pytest.fail(str(err))
        pytest.skip(str(err))


# -- the request contract, without a server --------------------------------------------------

SETTINGS = protocol.ServingSettings(
    artifact_dir="/a", profiles={"default": resolve_profile("default"), "small": resolve_profile("small")},
    default_profile="default", max_new_tokens_limit=100, default_max_new_tokens=16)


def _inputs(**values):
    arrays = {}
    for name, value in values.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif isinstance(value, (str, bytes)):
            arrays[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
        elif isinstance(value, bool):
            arrays[name] = np.array([value])
        elif isinstance(value, int):
            arrays[name] = np.array([value], dtype=np.int32)
        else:
            arrays[name] = np.array([s.encode() for s in value], dtype=np.object_)
    return arrays.get


def test_parse_request_reads_every_input_and_defaults():
    req = protocol.parse_request(_inputs(prompt="Hi", chat=False, max_new_tokens=7, profile="small",
                                         stop=["\n\n", "."]), SETTINGS)
    assert (req.prompt, req.chat, req.max_new_tokens, req.profile, req.stop) == ("Hi", False, 7, "small", ["\n\n", "."])
    kwargs = req.stream_kwargs(SETTINGS)
    assert kwargs["profile"] == resolve_profile("small") and kwargs["sampling"] == SamplingParams()
    req = protocol.parse_request(_inputs(prompt_token_ids=np.array([1, 5, 9], dtype=np.int64)), SETTINGS)
    assert (req.prompt, req.chat, req.max_new_tokens, req.profile, req.stop) == ([1, 5, 9], None, 16, "default", [])
    greedy = protocol.parse_request(_inputs(prompt="x", profile="greedy"), SETTINGS).stream_kwargs(SETTINGS)
    assert greedy["profile"] is GREEDY and "lookahead" not in greedy  # the one spelling of plain greedy


@pytest.mark.parametrize("values, error, message", [
    ({}, GenerationError, "give exactly one of the inputs prompt (text) and prompt_token_ids"),
    ({"prompt": "a", "prompt_token_ids": np.array([1])}, GenerationError, "give exactly one of the inputs"),
    ({"prompt": b"caf\xe9"}, GenerationError, "input prompt is not UTF-8 text (byte 3)"),
    ({"prompt": np.array([b"a", b"b"], dtype=np.object_)}, GenerationError, "input prompt must hold one value, got shape [2]"),
    ({"prompt_token_ids": np.array([1, 2]), "chat": True}, GenerationError,
     "chat=true needs a text prompt (prompt_token_ids are used as given)"),
    ({"prompt": "a", "max_new_tokens": 101}, GenerationError, "max_new_tokens must be between 1 and 100 on this model, got 101"),
    ({"prompt": "a", "max_new_tokens": 0}, GenerationError, "max_new_tokens must be between 1 and 100 on this model, got 0"),
    ({"prompt": "a", "profile": "paper"}, ProfileError, "unknown profile 'paper'; this model serves: default, small, greedy"),
    ({"prompt": "a", "profile": "/etc/passwd"}, ProfileError, "unknown profile '/etc/passwd'"),
    ({"prompt": "a", "stop": [""]}, GenerationError, "stop strings must not be empty"),
])
def test_parse_request_errors_are_one_line(values, error, message):
    with pytest.raises(error) as info:
        protocol.parse_request(_inputs(**values), SETTINGS)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_chunk_outputs_have_the_documented_dtypes_and_shapes():
    mid = protocol.chunk_outputs(Chunk("ü b", [7, 8]))
    assert mid["text"].dtype == object and mid["text"].tolist() == ["ü b".encode()]
    assert mid["token_ids"].dtype == np.int64 and mid["token_ids"].tolist() == [7, 8]
    assert mid["stop_reason"].tolist() == [b""] and mid["stats"].tolist() == [b""]
    stats = GenerationStats(prompt_tokens=3, new_tokens=5, steps=4, decode_s=0.5)
    last = protocol.chunk_outputs(Chunk("", [], "cancelled", stats), {"profile": "small"})
    assert last["token_ids"].shape == (0,)
    assert last["stop_reason"].tolist() == [b"cancelled"]
    decoded = json.loads(last["stats"][0])
    assert (decoded["new_tokens"], decoded["steps"], decoded["compression_ratio"], decoded["profile"],
            decoded["stop_reason"]) == (5, 4, 1.25, "small", "cancelled")
    assert set(mid) == {s.name for s in protocol.OUTPUTS}


def test_settings_round_trip_through_parameters():
    params = SETTINGS.to_parameters()
    assert all(isinstance(v, str) for v in params.values())
    back = protocol.ServingSettings.from_parameters(params)
    assert back == SETTINGS
    with pytest.raises(ServingError, match="profile name 'greedy' is reserved"):
        protocol.ServingSettings(artifact_dir="/a", profiles={"greedy": resolve_profile("small")}, default_profile="greedy")
    with pytest.raises(ServingError, match="parameter max_new_tokens_limit must be an integer, got 'many'"):
        protocol.ServingSettings.from_parameters({**params, "max_new_tokens_limit": "many"})


def test_scheduler_settings_round_trip_and_default_by_backend():
    params = SETTINGS.to_parameters()
    assert (params["batching"], params["token_budget"], params["kv_tokens"], params["width_policy"]) == (
        "true", "64", "0", "adaptive")
    unbatched = protocol.ServingSettings(artifact_dir="/a", profiles={}, default_profile="greedy", batching=False,
                                         token_budget=16, kv_tokens=2048, width_policy="profile")
    assert protocol.ServingSettings.from_parameters(unbatched.to_parameters()) == unbatched
    # a config written before the scheduler has no batching parameter: on for ort, off for tensorrt
    old = {k: v for k, v in params.items() if k not in ("batching", "token_budget", "kv_tokens", "width_policy")}
    assert protocol.ServingSettings.from_parameters(old).batching is True
    assert protocol.ServingSettings.from_parameters(old).width_policy == "adaptive"
    trt = protocol.ServingSettings.from_parameters({**old, "backend": "tensorrt", "device": "cuda"})
    assert (trt.batching, trt.token_budget, trt.kv_tokens) == (False, 64, 0)
    with pytest.raises(ServingError) as info:
        protocol.ServingSettings.from_parameters({**params, "backend": "tensorrt", "device": "cuda"})
    assert str(info.value) == ("batching needs the ort backend: TensorRT engines' optimization profiles do not cover "
                               "packed passes yet (write the model with --no-batching)")
    with pytest.raises(ServingError, match="^parameter batching must be true or false, got 'yes'$"):
        protocol.ServingSettings.from_parameters({**params, "batching": "yes"})
    with pytest.raises(ServingError, match="^token_budget must be an integer ≥ 1, got 0$"):
        protocol.ServingSettings.from_parameters({**params, "token_budget": "0"})
    with pytest.raises(ServingError, match="^width_policy must be adaptive or profile, got 'wide'$"):
        protocol.ServingSettings.from_parameters({**params, "width_policy": "wide"})


def test_docs_list_every_tensor_with_its_type_and_shape():
    for spec in (*protocol.INPUTS, *protocol.OUTPUTS, *protocol.RESERVED_INPUTS):
        dims = "[" + ", ".join(map(str, spec.dims)) + "]"
        row = re.search(rf"^\| `{spec.name}` \| `{spec.data_type}` \| `{re.escape(dims)}` \|", SERVING_DOC, re.M)
        assert row, f"docs/serving.md has no row for {spec.name} ({spec.data_type} {dims})"


# -- the repository ------------------------------------------------------------------------------

def test_repository_references_the_artifact_and_parses_as_a_model_config(tmp_path, stories_artifact):
    _require("tritonclient.grpc")
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    model = write_model_repository(stories_artifact, tmp_path / "repo", instances=3, profiles=["small", "2,3,1"],
                                   max_new_tokens_limit=200)
    assert model == (tmp_path / "repo" / "stories260K").resolve()
    assert sorted(str(p.relative_to(model)) for p in model.rglob("*")) == ["1", "1/model.py", "config.pbtxt", MARKER]
    config = text_format.Parse((model / "config.pbtxt").read_text(), mc.ModelConfig())
    assert (config.name, config.backend, config.max_batch_size, config.model_transaction_policy.decoupled) == (
        "stories260K", "python", 0, True)
    assert [(i.name, mc.DataType.Name(i.data_type), list(i.dims), i.optional) for i in config.input] == [
        (s.name, s.data_type, list(s.dims), True) for s in protocol.INPUTS]
    assert [(o.name, mc.DataType.Name(o.data_type), list(o.dims)) for o in config.output] == [
        (s.name, s.data_type, list(s.dims)) for s in protocol.OUTPUTS]
    assert (config.instance_group[0].count, mc.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind)) == (
        3, "KIND_CPU")
    settings = protocol.ServingSettings.from_parameters({k: v.string_value for k, v in config.parameters.items()})
    assert settings.artifact_dir == str(stories_artifact.resolve())
    assert list(settings.profiles) == ["small", "w2n3g1"] and settings.default_profile == "small"
    assert settings.profiles["w2n3g1"] == resolve_profile("2,3,1")
    assert (settings.max_new_tokens_limit, settings.default_max_new_tokens) == (200, 200)
    provenance = json.loads((model / MARKER).read_text())
    assert provenance["artifact"]["copied"] is False and provenance["instances"] == 3


def test_repository_with_a_copied_artifact_is_self_contained(tmp_path, stories_artifact):
    repo = tmp_path / "repo"
    (repo / "other").mkdir(parents=True)  # another model in the repository is kept
    model = write_model_repository(stories_artifact, repo, name="tiny", copy_artifact=True, device="cuda", instances=2)
    copied = model / "1" / "artifact"
    assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in stories_artifact.iterdir())
    assert (copied / "model.onnx").read_bytes() == (stories_artifact / "model.onnx").read_bytes()
    text = (model / "config.pbtxt").read_text()
    assert 'parameters { key: "artifact_dir" value: { string_value: "artifact" } }' in text
    assert "instance_group [ { count: 2 kind: KIND_GPU } ]" in text
    assert sorted(os.listdir(repo)) == ["other", "tiny"]
    # --force replaces a model this command wrote, never anything else
    again = write_model_repository(stories_artifact, repo, name="tiny", force=True, artifact_path="/mnt/art")
    assert 'string_value: "/mnt/art"' in (again / "config.pbtxt").read_text() and not (again / "1" / "artifact").exists()
    with pytest.raises(ArtifactError, match=r"it is not a model written by lade-export triton \(no lade_export.json\)"):
        write_model_repository(stories_artifact, repo, name="other", force=True)


def test_repository_passes_the_scheduler_options(tmp_path, stories_artifact):
    def settings(**kwargs):
        model = write_model_repository(stories_artifact, tmp_path / "repo", name="m", force=True, **kwargs)
        params = json.loads((model / MARKER).read_text())["parameters"]  # as written into config.pbtxt
        assert f'parameters {{ key: "batching" value: {{ string_value: "{params["batching"]}" }} }}' in (
            model / "config.pbtxt").read_text()
        return protocol.ServingSettings.from_parameters(params)

    got = settings(max_concurrent_requests=4, token_budget=32, kv_tokens=1500, width_policy="profile")
    assert (got.batching, got.max_concurrent_requests, got.token_budget, got.kv_tokens, got.width_policy) == (
        True, 4, 32, 1500, "profile")
    got = settings()
    assert (got.batching, got.token_budget, got.kv_tokens, got.width_policy) == (True, 64, 0, "adaptive")
    assert settings(batching=False).batching is False
    with pytest.raises(ServingError) as info:
        write_model_repository(stories_artifact, tmp_path / "repo", name="m", force=True, batching=False, kv_tokens=9)
    assert str(info.value) == "--kv-tokens is an option of the scheduler, and this model has none (--no-batching)"
    with pytest.raises(ServingError) as info:
        write_model_repository(stories_artifact, tmp_path / "repo", name="m", force=True, batching=False,
                               width_policy="profile")
    assert str(info.value) == "--width-policy is an option of the scheduler, and this model has none (--no-batching)"


def test_the_model_template_renders_the_default_config():
    text = render_config("m", SETTINGS, 1)
    assert text.count("optional: true") == len(protocol.INPUTS)
    assert '"{\\"default\\":{\\"name\\":\\"default\\"' in text  # the profiles' JSON, quoted for the text format


# -- the real server on stories260K ------------------------------------------------------------

PROMPTS = [  # (request, profile used): different prompts, profiles, stops, token ids, BOS only
    (dict(prompt="Once upon a time", max_new_tokens=64), "default"),  # the model's default profile
    (dict(prompt="The little dog", max_new_tokens=48, profile="small"), "small"),
    (dict(prompt="Lily and Tom went to the park", max_new_tokens=80, profile="greedy"), "greedy"),
    (dict(prompt="One day, a bird", max_new_tokens=60, profile="default", stop=["."]), "default"),
    (dict(prompt="Tim had a red ball", max_new_tokens=96, profile="small", stop=["ball", "!"]), "small"),
    (dict(prompt_token_ids=[1, 403, 407, 261, 378, 432, 383, 286, 261, 280, 294], max_new_tokens=50,
          profile="default"), "default"),
    (dict(prompt="", max_new_tokens=30, profile="greedy"), "greedy"),
    (dict(prompt="Once upon a time, there was a big", max_new_tokens=120), "default"),
    (dict(prompt="Tom found a shell", max_new_tokens=64, profile="small", temperature=0.8, top_p=0.9, seed=5),
     "small"),  # sampled: the same seed gives the in-process text
]


@pytest.fixture(scope="session")
def triton_env(tmp_path_factory):
    _require_triton()
    from lade_export.serving.local import default_extra_paths, make_server_env

    return make_server_env(tmp_path_factory.mktemp("triton") / "env", default_extra_paths())


@pytest.fixture(scope="module")
def stories_model(stories_artifact):
    import lade_export

    with lade_export.load(stories_artifact) as model:
        yield model


@pytest.fixture(scope="module")
def stories_server(tmp_path_factory, stories_artifact, triton_env):
    from lade_export.serving.local import LocalTritonServer

    tmp = tmp_path_factory.mktemp("stories-triton")
    # one instance with its scheduler: the recommended setup (docs/serving.md, Scaling)
    write_model_repository(stories_artifact, tmp / "repo", name="stories", instances=1,
                           profiles=["default", "small"], max_new_tokens_limit=480, default_max_new_tokens=32)
    server = LocalTritonServer(tmp / "repo", tmp / "run", env_dir=triton_env)
    try:
        server.start()
        yield server
    finally:
        server.stop()  # also after a failed test; a second stop is a no-op


def _run(coro):
    return asyncio.run(coro)


async def _gather(url, requests, model="stories", **kwargs):
    """Send the requests at once, each on its own stream (ids r0, r1, …); their results in order."""
    from tritonclient.grpc.aio import InferenceServerClient

    from lade_export.serving.client import stream_generate

    client = InferenceServerClient(url)
    try:
        return await asyncio.gather(*(stream_generate(client, model, request_id=f"r{i}", **r, **kwargs)
                                      for i, r in enumerate(requests)))
    finally:
        await client.close()


def _in_process(model, request, profile):
    prompt = request["prompt_token_ids"] if "prompt_token_ids" in request else request["prompt"]
    sampling = {k: request[k] for k in ("temperature", "top_k", "top_p", "seed") if k in request}
    return model.generate(prompt, max_new_tokens=request["max_new_tokens"], stop=request.get("stop"),
                          profile=None if profile == "greedy" else resolve_profile(profile),
                          lookahead=profile != "greedy", **sampling)


def test_nine_concurrent_streams_share_passes_and_equal_their_solo_runs(stories_server, stories_model):
    assert stories_model.encode("Once upon a time, there was a cat") == PROMPTS[5][0]["prompt_token_ids"]
    [first] = _run(_gather(stories_server.grpc_url, [dict(prompt="Hi", max_new_tokens=1, profile="greedy")]))
    before = first.stats["scheduler"]  # the instance's counters before the nine
    assert {k: before[k] for k in ("max_batch", "token_budget", "kv_tokens")} == {
        "max_batch": 8, "token_budget": 64, "kv_tokens": 8 * 512}
    results = _run(_gather(stories_server.grpc_url, [request for request, _ in PROMPTS]))
    instances = set()
    for (request, profile), got in zip(PROMPTS, results):
        want = _in_process(stories_model, request, profile)  # alone, on its own passes (no scheduler)
        assert got.error is None, got.error
        assert got.text == want.text, request
        assert got.token_ids == want.token_ids, request
        assert got.stop_reason == want.stop_reason
        assert got.stats["profile"] == profile and got.stats["new_tokens"] == len(want.token_ids)
        assert len(got.response_s) == got.stats["steps"]  # one response per decode step
        instances.add(got.stats["instance"])
    assert {r.stop_reason for r in results} >= {"stop_string", "max_new_tokens"}
    assert instances == {"stories_0_0"}
    # The scheduler packed them: alone, every decode step is a pass of its own (plus prefill
    # passes); here the nine took fewer passes than their decode steps.
    after = max((r.stats["scheduler"] for r in results), key=lambda s: s["passes"])
    steps = sum(r.stats["steps"] for r in results)
    assert after["passes"] - before["passes"] < steps, (after, before, steps)
    assert after["shared_passes"] > before["shared_passes"] and after["most_requests_per_pass"] >= 2


def test_a_cancelled_request_stops_early(stories_server, stories_model):
    full = stories_model.generate("Once upon a time", max_new_tokens=480, lookahead=False)
    [got] = _run(_gather(stories_server.grpc_url, [dict(prompt="Once upon a time", max_new_tokens=480,
                                                        profile="greedy")], cancel_after=2))
    assert got.cancelled and len(got.response_s) == 2
    pattern = re.compile(r"request r0 cancelled by the client after (\d+) new tokens \(max_new_tokens 480\)")
    deadline = time.monotonic() + 90  # the instance logs it at its next step; slow on a loaded machine
    while not (found := pattern.search(stories_server.log_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert found, stories_server.log_text()[-2000:]
    assert 2 <= int(found.group(1)) < len(full.token_ids)


def test_bad_requests_get_error_responses_and_the_server_keeps_serving(stories_server, stories_model):
    long_prompt = "Once upon a time there was a dog. " * 60
    n_long = len(stories_model.encode(long_prompt))
    bad = [
        dict(prompt="Once upon a time", profile="paper"),
        dict(prompt=long_prompt, max_new_tokens=32),
        dict(prompt="Hi", max_new_tokens=481),
        dict(prompt="Hi", prompt_token_ids=[1, 2]),
        dict(prompt_token_ids=[1, 2], chat=True),
        dict(prompt="Hi", temperature=1.0, top_p=0.0),
    ]
    results = _run(_gather(stories_server.grpc_url, bad))
    assert [r.error for r in results] == [
        "unknown profile 'paper'; this model serves: default, small, greedy",
        f"prompt ({n_long} tokens) + max_new_tokens (32) = {n_long + 32} exceeds the model's context of 512 tokens",
        "max_new_tokens must be between 1 and 480 on this model, got 481",
        "give exactly one of the inputs prompt (text) and prompt_token_ids",
        "chat=true needs a text prompt (prompt_token_ids are used as given)",
        "top_p must be in (0, 1], got 0.0",
    ]
    assert all(not r.token_ids for r in results)
    [good] = _run(_gather(stories_server.grpc_url, [dict(prompt="Once upon a time")]))  # default max_new_tokens 32
    assert good.error is None and good.token_ids == stories_model.generate("Once upon a time", max_new_tokens=32).token_ids
    log = stories_server.log_text()
    assert "is not healthy" not in log and log.count(": loaded ") == 1  # the instance did not restart


def test_request_values_at_their_edges_on_the_server(stories_server, stories_model):
    # A raw prompt with a control string and the parse_special_in_messages input (stories has
    # no chat template: its text is raw either way), a temperature below 1e-5, an empty stop.
    raw = "Once upon a time</s>"
    assert stories_model.encode(raw)[-1] == 2
    requests = [dict(prompt=raw, chat=False, parse_special_in_messages=True, max_new_tokens=8, profile="greedy"),
                dict(prompt="Once upon a time", temperature=1e-30, seed=1, max_new_tokens=24),
                dict(prompt="Once upon a time", stop=["", "."])]
    special, tiny, empty_stop = _run(_gather(stories_server.grpc_url, requests))
    assert special.error is None
    assert special.token_ids == stories_model.generate(raw, max_new_tokens=8, lookahead=False).token_ids
    assert tiny.error is None and tiny.stats["decoding"] == "greedy"
    assert tiny.token_ids == stories_model.generate("Once upon a time", max_new_tokens=24).token_ids
    assert empty_stop.error == "stop strings must not be empty" and not empty_stop.token_ids


def test_stopping_leaves_nothing_running(stories_server):
    # the last test of the module: stop the shared server and check what it leaves
    stubs = dict(stories_server.stubs)
    assert len(stubs) == 1  # one stub process per instance
    ports = (stories_server.grpc_port, stories_server.http_port)
    stories_server.stop()
    # a graceful stop: every request was released, so the models unloaded before the exit timeout
    assert stories_server.process.returncode == 0, stories_server.log_text()[-2000:]
    assert "Exit timeout expired" not in stories_server.log_text()
    assert stories_server.leftover_processes() == []
    for pid, region in stubs.items():
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        assert not Path(f"/dev/shm/{region}").exists()
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger in TIME_WAIT
            s.bind(("127.0.0.1", port))  # the ports are free again


def test_a_missing_artifact_fails_the_model_load_with_one_line(tmp_path, stories_artifact, triton_env):
    from lade_export.serving.local import LocalTritonServer

    write_model_repository(stories_artifact, tmp_path / "repo", name="gone", artifact_path=str(tmp_path / "nowhere"))
    server = LocalTritonServer(tmp_path / "repo", tmp_path / "run", env_dir=triton_env, exit_timeout_s=2)
    try:
        with pytest.raises(ServingError) as info:
            server.start(timeout_s=120, attempts=1)
        assert f"artifact directory not found: {tmp_path / 'nowhere'}" in server.log_text()
        assert str(info.value).startswith("tritonserver exited with status")
    finally:
        server.stop()
    assert server.leftover_processes() == []


ORPHAN = """
import sys, time
from lade_export.serving.local import LocalTritonServer
server = LocalTritonServer(sys.argv[1], sys.argv[2], env_dir=sys.argv[3])
server.start()
print(server.process.pid, *server.stubs.values(), flush=True)
time.sleep(600)
"""


def test_the_server_dies_with_the_process_that_started_it(tmp_path, stories_artifact, triton_env):
    import subprocess
    import sys

    from lade_export.serving.local import _group_members

    write_model_repository(stories_artifact, tmp_path / "repo", name="orphan")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN, str(tmp_path / "repo"), str(tmp_path / "run"),
                               str(triton_env)], stdout=subprocess.PIPE, text=True, env=env)
    regions = []
    try:
        server_pid, *regions = parent.stdout.readline().split()
        assert _group_members(int(server_pid)), "the server was not running"
        parent.kill()  # SIGKILL: no finalizer, no atexit in the parent
        parent.wait(timeout=10)
        deadline = time.monotonic() + 60  # the kernel delivers the parent-death signal; slow on a loaded machine
        while _group_members(int(server_pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group_members(int(server_pid)) == []  # the parent-death signal took the server and its stubs
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()
        for region in regions:  # a stub killed mid-flight may leave its region: do not leak it from a test
            Path(f"/dev/shm/{region}").unlink(missing_ok=True)


# -- SmolLM2 (chat template), two instances ---------------------------------------------------

@pytest.mark.slow
def test_smollm2_two_instances_four_streams_equal_in_process_greedy(tmp_path, smollm2_artifact, triton_env):
    import lade_export
    from lade_export.serving.local import LocalTritonServer

    prompts = mt_bench_prompts(4)
    with lade_export.load(smollm2_artifact) as model:
        assert model.tokenizer.has_chat_template
        want = [model.generate(p, max_new_tokens=64, lookahead=False) for p in prompts]  # chat template by default
    # profile widths: the adaptive policy may give a busy pass one-token steps, and then no
    # step is saved; at full width the saving below holds whatever the machine's load
    write_model_repository(smollm2_artifact, tmp_path / "repo", name="smollm2", instances=2, width_policy="profile")
    with LocalTritonServer(tmp_path / "repo", tmp_path / "run", env_dir=triton_env) as server:
        results = _run(_gather(server.grpc_url, [dict(prompt=p, max_new_tokens=64) for p in prompts], model="smollm2"))
        log = server.log_text()
    assert server.leftover_processes() == []
    for prompt, w, got in zip(prompts, want, results):
        assert got.error is None, got.error
        assert got.token_ids == w.token_ids, prompt[:60]
        assert got.text == w.text
        assert got.stats["profile"] == "default" and got.stats["new_tokens"] == len(w.token_ids)
    assert log.count(": loaded ") == 2
    assert sum(r.stats["steps"] for r in results) < sum(len(w.token_ids) for w in want)  # lookahead saved steps
