"""``POST /v1/check``: ``planner check --json`` of files sent as text; a file another names is found
among those sent, never on the server's disk; a model over HTTP is a catalog id or sent inline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("trl")

from fastapi.testclient import TestClient  # noqa: E402

from planner.service import create_app  # noqa: E402
from planner.service.settings import ServiceSettings  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "check"
HF = DATA / "hf"


@pytest.fixture
def client(tmp_path):
    with TestClient(create_app(ServiceSettings(database_url=f"sqlite:///{tmp_path / 'planner.db'}"))) as c:
        yield c


def _sent(*paths: Path) -> list[dict]:
    return [{"name": p.name, "content": p.read_text()} for p in paths]


def test_check_is_check_json_with_the_files_sent(client, cli, monkeypatch):
    body = {"gpu": "a10g", "seq_len": 1024,
            "files": _sent(HF / "training_args.json", HF / "ds_config.json", HF / "adapter_config.json")}
    answer = client.post("/v1/check", json=body)
    assert answer.status_code == 200, answer.text
    monkeypatch.chdir(HF)
    printed = cli("check", "training_args.json", "--gpu", "a10g", "--seq-len", "1024", "--json")
    assert printed.code == 0, printed
    mine, theirs = answer.json(), json.loads(printed.out)
    assert sorted(mine["files"]) == sorted(theirs["files"])
    assert {k: mine[k] for k in ("fits", "peak_bytes", "peak_phase", "oom_probability", "change", "estimate")} == \
        {k: theirs[k] for k in ("fits", "peak_bytes", "peak_phase", "oom_probability", "change", "estimate")}


def test_a_referenced_file_must_be_sent_and_the_server_reads_no_path(client):
    answer = client.post("/v1/check", json={"gpu": "a10g", "files": _sent(HF / "training_args.json")})
    assert answer.status_code == 422
    assert "deepspeed names ds_config.json, which was not sent: send it too" in answer.json()["error"]
    args = json.loads((HF / "training_args.json").read_text())
    args["model_name_or_path"] = str(DATA.parent / "models")  # a path on the server: refused, not read
    del args["deepspeed"]
    answer = client.post("/v1/check", json={"gpu": "a10g", "files": [{"name": "a.json", "content": json.dumps(args)}]})
    assert answer.status_code == 422 and "is not a catalog id" in answer.json()["error"], answer.text


def test_a_file_name_with_a_folder_is_refused(client):
    answer = client.post("/v1/check", json={"gpu": "a10g", "files": [{"name": "../etc/x.json", "content": "{}"}]})
    assert answer.status_code == 422


def test_check_reads_an_axolotl_and_a_llama_factory_config_sent_as_text(client):
    # the LLaMA-Factory example's -Instruct release is no catalog id of its own: the server takes ids only
    for path, model, schema in ((DATA / "axolotl" / "llama3_qlora.yml", None, "axolotl 0.19.0"),
                                (DATA / "llama_factory" / "llama3_lora_sft.yaml", "meta-llama/Meta-Llama-3-8B",
                                 "llama-factory 0.9.5")):
        answer = client.post("/v1/check", json={"gpu": "a10g", "files": _sent(path), "model": model})
        assert answer.status_code == 200, answer.text
        assert answer.json()["schema"].startswith(schema) and answer.json()["change"]["diff"], answer.text
    torchtune = DATA / "torchtune" / "1B_lora_single_device.yaml"
    answer = client.post("/v1/check", json={"gpu": "a10g", "files": _sent(torchtune), "trainer": "torchtune"})
    assert answer.status_code == 422 and "no file names the model" in answer.json()["error"]  # its folder is not read
    answer = client.post("/v1/check", json={"gpu": "a10g", "files": _sent(torchtune),
                                            "model": "meta-llama/Llama-3.2-1B"})
    assert answer.status_code == 200 and answer.json()["schema"].startswith("torchtune 0.6.1"), answer.text
