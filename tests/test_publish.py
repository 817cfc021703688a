"""`flashrl publish` and Hub-resolved FLASHRL_CONFIG, against a local Hub (tests/hub_server.py).

The real huggingface_hub client does the talking, in separate processes (it reads HF_ENDPOINT,
HF_HOME and HF_HUB_OFFLINE from the environment at import, as on a training node). The engine
test is in test_runtime_vllm.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hub_server import HubServer
from flashrl_tools import __version__
from flashrl_tools.fsutil import sha256_file
from flashrl_tools.profile.build import build_profile
from flashrl_tools.profile.format import load_profile, save_profile
from flashrl_tools.quant.quantize import quantize
from flashrl_tools.safetensors_io import CheckpointReader
from flashrl_tools.setup.write import build_entry, setup

RESOLVE = """
import json, os, sys
from flashrl_tools.errors import FlashRLError
from flashrl_tools.config.resolve import resolve
try:
    rc = resolve(os.environ["FLASHRL_CONFIG"])
except FlashRLError as e:
    print(e.message, file=sys.stderr); sys.exit(2)
print(json.dumps(rc.entry.model_dump(mode="json")))
"""


@pytest.fixture()
def hub():
    with HubServer() as server:
        yield server


@pytest.fixture(scope="module")
def local_config(tiny_models, tmp_path_factory) -> dict:
    """A `flashrl setup` config: tiny INT8 checkpoint + its profile."""
    root = tmp_path_factory.mktemp("pub")
    bf16 = tiny_models["llama-untied"]
    q = quantize(bf16, root / "tiny-int8", "int8").out
    prof = root / "profiles" / "tiny.safetensors"
    save_profile(build_profile(bf16, q, "int8").profile, prof)
    cfg = root / "flashrl.yaml"
    setup(cfg, build_entry("int8", q, prof, {}))
    return {"config": cfg, "model": q, "profile": prof, "root": root}


def env_for(hub_url: str, tmp: Path, name: str = "node", **extra) -> dict:
    """A node: its own HF cache and flashrl home; no token unless given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FLASHRL_"))}
    return {**env, "HF_ENDPOINT": hub_url, "HF_HOME": str(tmp / name / "hf"),
            "FLASHRL_HOME": str(tmp / name / "flashrl"), **extra}


def publish(args: list, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashrl_tools", "publish", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def resolve(value: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RESOLVE], capture_output=True, text=True, timeout=300,
                          env={**env, "FLASHRL_CONFIG": value})


def ok_entry(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def one_error(res: subprocess.CompletedProcess, *words: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in res.stderr, (w, res.stderr)
    return res.stderr


def pinned_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, res.stderr[-3000:]
    line = res.stdout.strip().splitlines()[-1]
    assert line.startswith("FLASHRL_CONFIG="), res.stdout
    return line.split("=", 1)[1]


def repo_files(hub: HubServer, repo_id: str, rev: str = "main") -> dict[str, bytes]:
    repo = hub.state.repos[repo_id]
    return repo.commits[repo.refs.get(rev, rev)]


def push_files(hub: HubServer, repo_id: str, files: dict[str, bytes], owner: str = "alice",
               private: bool = False) -> str:
    """Another client's commit (the server's state, directly): a changed file, a legacy config."""
    from hub_server import Repo

    repo = hub.state.repos.setdefault(repo_id, Repo(owner=owner, private=private))
    parent = repo.refs.get("main")
    sha = hub.state.new_commit(repo, parent, {**(repo.commits[parent] if parent else {}), **files})
    repo.refs["main"] = sha
    return sha


# -- publish ----------------------------------------------------------------------------------

def test_dry_run_lists_the_upload_and_contacts_nobody(hub, local_config, tmp_path):
    res = publish([local_config["config"], "--repo", "alice/tiny", "--path-in-repo", "int8", "--dry-run"],
                  env_for(hub.url, tmp_path))
    assert res.returncode == 0, res.stderr
    for path in ("int8/flashrl.yaml", "int8/tiny.safetensors", "int8/README.md"):
        assert path in res.stdout
    assert "profile: tiny.safetensors" in res.stdout  # rewritten relative to the config
    assert "FLASHRL_CONFIG=alice/tiny/int8/flashrl.yaml@<commit>" in res.stdout
    assert "stays the local path" in res.stderr  # model: a local path, said so
    assert not [r for r in hub.state.requests if "/api/agent" not in r[1]], hub.state.requests


def test_publish_and_resolution_validate_a_profiled_config_without_torch(hub, local_config, tmp_path):
    """A config's validation reads the profile's header and hashes files, no tensor: `flashrl publish` and a
    node's resolution answer without importing torch (~4 s of each answer on two cores)."""
    env = env_for(hub.url, tmp_path)
    cli = ("import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_module('flashrl_tools', run_name='__main__')\n"
           "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", cli, "flashrl", "publish", str(local_config["config"]), "--repo",
                          "alice/tiny", "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert res.stdout.strip().splitlines()[-1] == "exit 0 False", res.stdout[-2000:] + res.stderr[-2000:]
    res = subprocess.run([sys.executable, "-c", RESOLVE.replace("print(json", "print('torch' in sys.modules, json")],
                         capture_output=True, text=True, timeout=300, env={**env, "FLASHRL_CONFIG": str(local_config["config"])})
    assert res.returncode == 0 and res.stdout.startswith("False "), res.stdout[-2000:] + res.stderr[-2000:]


def test_publish_one_commit_then_resolve_pinned_and_latest(hub, local_config, tmp_path):
    env = env_for(hub.url, tmp_path, "publisher", HF_TOKEN="hf_alice")
    first = pinned_line(publish([local_config["config"], "--repo", "alice/tiny"], env))
    assert first.startswith("alice/tiny/flashrl.yaml@")
    commit = first.rsplit("@", 1)[1]
    assert hub.state.count("POST", "/commit/") == 1  # config, profile and card in one commit
    files = repo_files(hub, "alice/tiny", commit)
    published = yaml.safe_load(files["flashrl.yaml"])["configs"][0]
    assert published["profile"] == "tiny.safetensors"
    assert published["profile_sha256"] == sha256_file(local_config["profile"])
    assert files["tiny.safetensors"] == local_config["profile"].read_bytes()
    card = files["README.md"].decode()
    for words in ("`int8`", "tiny-int8", __version__, "FLASHRL_CONFIG=alice/tiny/flashrl.yaml@<commit>"):
        assert words in card

    # a second publish of a changed config: the pinned ref keeps the first, the branch follows
    changed = local_config["root"] / "changed" / "flashrl.yaml"
    changed.parent.mkdir(exist_ok=True)
    data = yaml.safe_load(local_config["config"].read_text())
    data["configs"][0]["logprobs_mode"] = "raw_logprobs"
    changed.write_text(yaml.safe_dump(data))
    second = pinned_line(publish([changed, "--repo", "alice/tiny"], env))
    assert second != first
    node = env_for(hub.url, tmp_path, "node")
    entry = ok_entry(resolve(first, node))
    assert entry["logprobs_mode"] == "processed_logprobs"
    assert entry["model"] == str(local_config["model"])
    assert entry["profile"].endswith(f"snapshots/{commit}/tiny.safetensors")
    assert ok_entry(resolve("alice/tiny/flashrl.yaml", node))["logprobs_mode"] == "raw_logprobs"


def test_a_mixed_4_and_8_bit_config_publishes_and_resolves_with_its_4bit_layers(hub, tmp_path):
    """Issue 75: an online 8-bit config that serves some layers in 4 bits (`w4a16_layers`; no checkpoint, no
    profile: the engine quantizes the trainer's BF16 model layer by layer) publishes as one file; a node resolving
    the pinned ref gets the same layers, and the card names them."""
    cfg = tmp_path / "cfg" / "flashrl.yaml"
    setup(cfg, build_entry("int8", None, None, {"w4a16_layers": ["*.mlp.down_proj"]}))
    line = pinned_line(publish([cfg, "--repo", "alice/mix"], env_for(hub.url, tmp_path, "publisher",
                                                                      HF_TOKEN="hf_alice")))
    files = repo_files(hub, "alice/mix", line.rsplit("@", 1)[1])
    assert set(files) - {".gitattributes"} == {"flashrl.yaml", "README.md"}  # no profile to carry
    assert yaml.safe_load(files["flashrl.yaml"])["configs"][0]["w4a16_layers"] == ["*.mlp.down_proj"]
    assert "| 4-bit (W4A16): `*.mlp.down_proj` |" in files["README.md"].decode()
    entry = ok_entry(resolve(line, env_for(hub.url, tmp_path, "node")))
    assert entry["w4a16_layers"] == ["*.mlp.down_proj"] and entry["fn"] == "int8" and entry["model"] is None


def test_revision_branch(hub, local_config, tmp_path):
    env = env_for(hub.url, tmp_path, "publisher", HF_TOKEN="hf_alice")
    line = pinned_line(publish([local_config["config"], "--repo", "alice/br", "--revision", "exp",
                                "--path-in-repo", "cfg"], env))
    assert "cfg/flashrl.yaml" in repo_files(hub, "alice/br", "exp")
    assert "cfg/flashrl.yaml" not in repo_files(hub, "alice/br", "main")
    node = env_for(hub.url, tmp_path, "node")
    assert ok_entry(resolve("alice/br/cfg/flashrl.yaml@exp", node))["profile_sha256"]
    assert ok_entry(resolve(line, node))["profile_sha256"]
    one_error(resolve("alice/br/cfg/flashrl.yaml", node), "file not found in the repo")  # not on main
    one_error(resolve("alice/br/cfg/flashrl.yaml@nope", node), "revision not found")


def test_publish_errors_are_one_clear_line(hub, local_config, tmp_path):
    cfg = local_config["config"]
    env = env_for(hub.url, tmp_path)
    one_error(publish([cfg, "--repo", "alice/x"], env), "no Hugging Face token", "--token", "HF_TOKEN")
    one_error(publish([cfg, "--repo", "alice/x", "--token", "hf_wrong"], env), "rejected the token")
    push_files(hub, "bob/public", {"a.txt": b"a"}, owner="bob")
    push_files(hub, "bob/secret", {"a.txt": b"a"}, owner="bob", private=True)
    one_error(publish([cfg, "--repo", "bob/public", "--token", "hf_alice"], env), "permission denied")
    one_error(publish([cfg, "--repo", "bob/new", "--token", "hf_alice"], env), "permission denied")
    one_error(publish([cfg, "--repo", "bob/secret", "--token", "hf_alice"], env), "repo not found")
    with socket.socket() as s:  # a port nobody listens on: the network is down
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    one_error(publish([cfg, "--repo", "alice/x", "--token", "hf_alice"], env_for(down, tmp_path)),
              "cannot reach the Hub")
    one_error(publish([cfg, "--repo", "not-a-repo", "--token", "hf_alice"], env), "invalid --repo")
    one_error(publish([tmp_path / "missing.yaml", "--repo", "alice/x", "--token", "hf_alice"], env),
              "config file not found")
    assert "alice/x" not in hub.state.repos  # nothing created by any failed attempt


# -- resolve ----------------------------------------------------------------------------------

def test_offline_warm_cache_cold_cache_and_network_down(hub, local_config, tmp_path):
    line = pinned_line(publish([local_config["config"], "--repo", "alice/off", "--private"],
                               env_for(hub.url, tmp_path, "publisher", HF_TOKEN="hf_alice")))
    node = env_for(hub.url, tmp_path, "node")
    one_error(resolve(line, node), "repo not found")  # private: needs the token
    node["HF_TOKEN"] = "hf_alice"
    online = ok_entry(resolve(line, node))
    ok_entry(resolve("alice/off/flashrl.yaml", node))  # fills the cache's refs/main too
    served = len(hub.state.requests)
    # same HF cache, a fresh flashrl home (no node record): only the HF cache can answer
    warm = {**node, "HF_HUB_OFFLINE": "1", "FLASHRL_HOME": str(tmp_path / "other-flashrl")}
    assert ok_entry(resolve(line, warm)) == online
    assert ok_entry(resolve("alice/off/flashrl.yaml", {**warm, "FLASHRL_HOME": str(tmp_path / "f3")})) == online
    assert len(hub.state.requests) == served  # offline: the Hub was not asked
    cold = env_for(hub.url, tmp_path, "cold", HF_HUB_OFFLINE="1")
    one_error(resolve(line, cold), "not in the local Hugging Face cache", "HF_HUB_OFFLINE is set")
    hub.stop()  # network down: cold fails clearly, warm still works
    one_error(resolve(line, env_for(hub.url, tmp_path, "cold2")), "not in the local Hugging Face cache",
              "could not be reached")
    assert ok_entry(resolve(line, {**node, "FLASHRL_HOME": str(tmp_path / "f4")})) == online


def test_tampered_profile_is_refused(hub, local_config, tmp_path):
    line = pinned_line(publish([local_config["config"], "--repo", "alice/t"],
                               env_for(hub.url, tmp_path, "publisher", HF_TOKEN="hf_alice")))
    node = env_for(hub.url, tmp_path, "node")
    entry = ok_entry(resolve(line, node))
    # on the Hub: someone replaces the profile without re-publishing the config
    prof = load_profile(local_config["profile"])
    name = next(k for k in prof.tensors if k.endswith("_scale"))
    prof.tensors[name] = prof.tensors[name] * 1.01
    save_profile(prof, tmp_path / "evil.safetensors")
    push_files(hub, "alice/t", {"tiny.safetensors": (tmp_path / "evil.safetensors").read_bytes()})
    one_error(resolve("alice/t/flashrl.yaml", node), "does not match the sha256", "refusing to start")
    assert ok_entry(resolve(line, node)) == entry  # the pinned commit still has the right file
    # in the node's cache: the file changes after resolution
    blob = Path(entry["profile"]).resolve()
    blob.write_bytes((tmp_path / "evil.safetensors").read_bytes())
    one_error(resolve(line, node), "does not match the sha256")
    import shutil  # a cleaned cache: the node resolves again instead of pointing at missing files

    shutil.rmtree(tmp_path / "node" / "hf")
    assert ok_entry(resolve(line, node))["profile_sha256"] == entry["profile_sha256"]


def test_resolution_runs_once_per_node(hub, local_config, tmp_path):
    pinned_line(publish([local_config["config"], "--repo", "alice/once"],
                        env_for(hub.url, tmp_path, "publisher", HF_TOKEN="hf_alice")))
    node = {**env_for(hub.url, tmp_path, "node"), "FLASHRL_CONFIG": "alice/once/flashrl.yaml"}
    procs = [subprocess.Popen([sys.executable, "-c", RESOLVE], env=node, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({o for o, _ in outs}) == 1
    assert hub.state.count("GET", "/alice/once/resolve/") == 2  # the config and its profile, once each
    assert hub.state.count("HEAD", "/alice/once/resolve/") == 2


def test_model_on_the_hub(hub, local_config, tiny_models, tmp_path):
    """--model-repo: the config names the checkpoint on the Hub; each node downloads it and the
    runtime checks it is the one the profile was made from."""
    model = local_config["model"]
    push_files(hub, "alice/tiny-int8", {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()})
    env = env_for(hub.url, tmp_path, "publisher", HF_TOKEN="hf_alice")
    line = pinned_line(publish([local_config["config"], "--repo", "alice/m", "--model-repo", "alice/tiny-int8"], env))
    assert yaml.safe_load(repo_files(hub, "alice/m")["flashrl.yaml"])["configs"][0]["model"] == "alice/tiny-int8"
    entry = ok_entry(resolve(line, env_for(hub.url, tmp_path, "node")))
    assert "models--alice--tiny-int8/snapshots/" in entry["model"]
    assert sha256_file(Path(entry["model"]) / "model.safetensors") == sha256_file(model / "model.safetensors")
    # a --model-repo holding another checkpoint is refused at start
    other = quantize(tiny_models["llama-tied"], tmp_path / "other", "int8").out
    push_files(hub, "alice/other", {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()})
    line = pinned_line(publish([local_config["config"], "--repo", "alice/m2", "--model-repo", "alice/other"], env))
    one_error(resolve(line, env_for(hub.url, tmp_path, "node")), "made for another checkpoint")


def _legacy_pt(model: Path) -> dict:
    """flash-llm-rl's INT8 layout: name -> {input_scale, output_scale (1/scale), type}."""
    q = CheckpointReader(model)
    return {n.removesuffix("_scale"): {"input_scale": 1.0, "output_scale": 1.0 / q.get(n).float(),
                                       "type": torch.int8}
            for n in q.names() if n.endswith(".weight_scale")}


def test_legacy_pickled_profile_needs_the_opt_in(hub, local_config, tmp_path):
    model = local_config["model"]
    push_files(hub, "alice/tiny-int8", {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()})
    torch.save(_legacy_pt(model), tmp_path / "profile.pt")
    legacy = {"configs": [{"fn": "int8", "model": "alice/tiny-int8", "profile": "alice/legacy/profile.pt"}]}
    push_files(hub, "alice/legacy", {"profile.pt": (tmp_path / "profile.pt").read_bytes(),
                                     "flashrl.yaml": yaml.safe_dump(legacy).encode()})
    node = env_for(hub.url, tmp_path, "node")
    one_error(resolve("alice/legacy/flashrl.yaml", node), "pickle", "FLASHRL_ALLOW_LEGACY_PICKLE=1",
              "weights_only=True")
    entry = ok_entry(resolve("alice/legacy/flashrl.yaml", {**node, "FLASHRL_ALLOW_LEGACY_PICKLE": "1"}))
    converted = load_profile(Path(entry["profile"]))
    assert converted.meta.source == "flashrl-pt"
    assert set(converted.meta.quantized) == set(load_profile(local_config["profile"]).meta.quantized)
    # an arbitrary pickle is not executed even with the opt-in
    victim = tmp_path / "victim"
    victim.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.rmdir, (str(victim),))

    import pickle

    push_files(hub, "alice/legacy", {"profile.pt": pickle.dumps({"x": Evil()})})
    one_error(resolve("alice/legacy/flashrl.yaml", {**node, "FLASHRL_ALLOW_LEGACY_PICKLE": "1",
                                                    "FLASHRL_HOME": str(tmp_path / "f2")}), "weights_only=True")
    assert victim.is_dir()


def test_bad_hub_configs_are_clear_errors(hub, tmp_path):
    node = env_for(hub.url, tmp_path, "node")
    one_error(resolve("alice/none/flashrl.yaml", node), "repo not found")
    push_files(hub, "alice/bad", {"a.yaml": b"configs:\n- fn: int9\n",
                                  "b.yaml": yaml.safe_dump({"configs": [{"fn": "int8", "model": "/nope",
                                                                         "profile": "p.safetensors"}]}).encode(),
                                  "c.yaml": yaml.safe_dump({"configs": [{"fn": "int8", "model": "/nope",
                                                                         "profile": "../p.safetensors"}]}).encode()})
    one_error(resolve("alice/bad/a.yaml", node), "invalid value 'int9'", "alice/bad/a.yaml")
    one_error(resolve("alice/bad/b.yaml", node), "file not found in the repo")
    one_error(resolve("alice/bad/c.yaml", node), "outside the repo")
