"""LoRA adapters through the server: --lora-modules, `model` picking an adapter (completions
and chat, token for token against PEFT), /v1/models, and loading / unloading at run time."""

from __future__ import annotations

import json
import math
import shutil
import time

import httpx
import openai
import pytest
import zmq
from safetensors.torch import load_file, save_file

from kvtier.events import BlockStored, decode_batch
from kvtier.models.tokenizer import Tokenizer
from kvtier.router.prompts import PromptHasher, load_tokenizer

from ..lora.adapters import make_adapter
from ..tiny_models import hf_greedy
from .server_process import ServerProcess, free_port

GREEDY = {"temperature": 0.0, "max_tokens": 8,
          "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_lora")
    base = tiny_model[1]
    return {"all": (str(root / "all"), make_adapter(base, root / "all", seed=1)),
            "qv": (str(root / "qv"), make_adapter(base, root / "qv", seed=2,
                                                  targets=("q_proj", "v_proj"), r=8)),
            "late": (str(root / "late"), make_adapter(base, root / "late", seed=3))}


@pytest.fixture(scope="module")
def server(tiny_model, adapters):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{free_port()}"}
        proc = ServerProcess(tiny_model[0], "--served-model-name", "tiny",
                             "--num-device-blocks", "64", "--max-model-len", "256",
                             "--block-size", "16", "--kv-events-config", json.dumps(events),
                             "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                             "--lora-modules", f"all={adapters['all'][0]}",
                             f'{{"name": "qv", "path": "{adapters["qv"][0]}", '
                             '"base_model_name": "tiny-base"}')
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                       timeout=60.0) as c:
        yield c


def _expected(model, tiny_model, prompt_ids):
    return hf_greedy(model, [prompt_ids], GREEDY["max_tokens"])[0]


def test_models_lists_the_adapters_with_their_base(client, adapters):
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == ["tiny", "all", "qv"]
    assert (cards["all"].parent, cards["all"].root) == ("tiny", adapters["all"][0])
    assert cards["tiny"].parent is None
    assert client.models.retrieve("qv").parent == "tiny-base"  # its base_model_name


def test_each_model_name_generates_with_its_adapter(client, tiny_model, adapters):
    tokenizer = Tokenizer.from_hf_dir(tiny_model[0])
    prompt = "Adapters share one base"
    prompt_ids = tokenizer.encode(prompt)
    for name, model in (("tiny", tiny_model[1]), ("all", adapters["all"][1]),
                        ("qv", adapters["qv"][1])):
        result = client.completions.create(model=name, prompt=prompt, **GREEDY)
        assert result.model == name
        assert result.choices[0].token_ids == _expected(model, tiny_model, prompt_ids), name
    messages = [{"role": "user", "content": "hello"}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages,
                                                              add_generation_prompt=True),
                                add_special_tokens=False)
    result = client.chat.completions.create(model="qv", messages=messages, **GREEDY)
    assert result.choices[0].token_ids == _expected(adapters["qv"][1], tiny_model, chat_ids)


def test_unknown_model_is_a_404_naming_the_adapters(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert "tiny, all, qv" in info.value.body["message"]


def test_load_and_unload_at_run_time(server, client, tiny_model, adapters):
    tokenizer = Tokenizer.from_hf_dir(tiny_model[0])
    prompt_ids = tokenizer.encode("late adapter")
    path = adapters["late"][0]
    load = httpx.post(f"{server.url}/v1/load_lora_adapter",
                      json={"lora_name": "late", "lora_path": path}, timeout=30)
    assert load.status_code == 200, load.text
    assert load.text == "Success: LoRA adapter 'late' added successfully."
    assert [c.id for c in client.models.list().data][-1] == "late"
    result = client.completions.create(model="late", prompt="late adapter", **GREEDY)
    assert result.choices[0].token_ids == _expected(adapters["late"][1], tiny_model,
                                                    prompt_ids)
    again = httpx.post(f"{server.url}/v1/load_lora_adapter",
                       json={"lora_name": "late", "lora_path": path}, timeout=30)
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_already_loaded"
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter",
                     json={"lora_name": "bad", "lora_path": "/nowhere"}, timeout=30)
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
    empty = httpx.post(f"{server.url}/v1/load_lora_adapter",
                       json={"lora_name": "", "lora_path": path}, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "lora_name"
    unload = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"},
                        timeout=30)
    assert unload.status_code == 200, unload.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=1)
    gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"},
                      timeout=30)
    assert gone.status_code == 404


def test_an_adapter_with_nan_values_is_refused_at_load(server, client, adapters, tmp_path):
    """Such adapters once loaded, then every request using one failed as a 500 that blamed
    the grammar, allowed_token_ids, bad_words and min_tokens."""
    alpha = tmp_path / "nan_alpha"
    shutil.copytree(adapters["late"][0], alpha)
    config = json.loads((alpha / "adapter_config.json").read_text())
    (alpha / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": math.nan}))
    weights = tmp_path / "nan_weights"
    shutil.copytree(adapters["late"][0], weights)
    tensors = load_file(weights / "adapter_model.safetensors")
    next(t for name, t in sorted(tensors.items()) if "lora_A" in name)[0, 0] = math.nan
    save_file(tensors, weights / "adapter_model.safetensors")
    for name, path, problem in (("nan_alpha", alpha, "lora_alpha must be a positive finite"),
                                ("nan_weights", weights, "lora_A holds NaN or infinite")):
        load = httpx.post(f"{server.url}/v1/load_lora_adapter",
                          json={"lora_name": name, "lora_path": str(path)}, timeout=30)
        assert load.status_code == 400 and problem in load.json()["error"]["message"], \
            load.text
        assert name not in [c.id for c in client.models.list().data]


def test_bad_lora_options_fail_at_start(tiny_model, tmp_path):
    """One-line errors before serving: an adapter without --enable-lora, a malformed entry,
    an adapter that does not load."""
    for args, message in (
            (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
            (["--enable-lora", "--lora-modules", "a"], "give NAME=PATH"),
            (["--enable-lora", "--lora-modules", f"a={tmp_path}"], "no adapter_config.json")):
        with pytest.raises(RuntimeError) as info:
            ServerProcess(tiny_model[0], "--num-device-blocks", "64", *args)
        assert message in str(info.value)


def test_a_router_hashes_adapter_prompts_as_the_engine_does(server):
    """kv_events_info gives each adapter's key; a router's PromptHasher that learned them
    names the blocks of an adapter's request as the engine's BlockStored events do, and
    differently from the same prompt on the base model."""
    info = httpx.get(f"{server.url}/v1/kv_events_info", timeout=5.0).json()
    assert set(info["lora_adapters"]) >= {"all", "qv"}
    hasher = PromptHasher(load_tokenizer(info["model"]), info["block_size"], info["hash_algo"])
    hasher.add_adapters(info["lora_adapters"])
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(info["endpoint"])
    time.sleep(0.5)  # let the subscription reach the PUB socket
    try:
        stored = {}
        for model in ("qv", "tiny"):
            body = {"model": model, "prompt": "route me by my adapter " * 4, "max_tokens": 1}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            stored[model] = _stored_device_hashes(sub)
            token_ids = hasher.token_ids("/v1/completions", body)
            expected = hasher.block_hashes_of(token_ids, None, model)
            assert len(expected) >= 4 and stored[model][:len(expected)] == expected, model
        assert not set(stored["qv"]) & set(stored["tiny"])
    finally:
        sub.close(linger=0)


def _stored_device_hashes(sub) -> list[int]:
    assert sub.poll(10_000), "no KV events arrived"
    hashes: list[int] = []
    while sub.poll(300):
        for event in decode_batch(sub.recv_multipart()[2]).events:
            if isinstance(event, BlockStored) and event.medium == "GPU":
                hashes.extend(event.block_hashes)
    return hashes


def test_an_adapter_unloaded_after_the_model_check_is_a_404():
    """Between a request's model check and its start (a long prompt is tokenized on a
    thread) its adapter may be unloaded: the request is refused, never run on the base
    model."""
    from kvtier.entrypoints.openai.context import ServerContext
    from kvtier.entrypoints.openai.errors import NotFoundError
    from kvtier.entrypoints.openai.generation import to_api_error
    from kvtier.lora import LoRAError, LoRANotLoadedError, LoRARequest

    ctx = ServerContext(None, ("tiny",), None, None, None,
                        lora_modules={"a": LoRARequest("a", 1, "/a")})
    ctx.check_model("a")
    assert ctx.lora_request("a") == LoRARequest("a", 1, "/a")
    assert ctx.lora_request("tiny") is None and ctx.lora_request(None) is None
    del ctx.lora_modules["a"]
    with pytest.raises(NotFoundError, match="the model 'a' does not exist"):
        ctx.lora_request("a")
    # Unloaded after the server's last check: the engine's refusal is a 404 too; an adapter
    # that does not load is a 400.
    error = to_api_error(LoRANotLoadedError("LoRA adapter 'a' is not loaded"))
    assert (error.status_code, error.code, error.param) == (404, "model_not_found", "model")
    assert to_api_error(LoRAError("LoRA adapter /a: no adapter_config.json")).status_code == 400


def test_adapters_found_in_the_resolver_dir_load_on_demand(tiny_model, adapters, tmp_path):
    """--lora-resolver-dir: a request naming a subdirectory loads it; with --max-cpu-loras 1
    the adapters take turns in memory and each still answers with its own weights; names
    that are not one directory of it are 404s, a directory that is no adapter a 400."""
    root = tmp_path / "resolver"
    root.mkdir()
    for name in ("all", "qv"):
        (root / name).symlink_to(adapters[name][0])
    for name in ("broken", ".hidden"):
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text("{}")
    server = ServerProcess(tiny_model[0], "--served-model-name", "tiny",
                           "--num-device-blocks", "64", "--max-model-len", "256",
                           "--enable-lora", "--max-lora-rank", "8", "--max-cpu-loras", "1",
                           "--lora-resolver-dir", str(root))
    try:
        tokenizer = Tokenizer.from_hf_dir(tiny_model[0])
        prompt_ids = tokenizer.encode("found on demand")
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                           timeout=60.0) as client:
            for name in ("all", "qv", "all"):
                result = client.completions.create(model=name, prompt="found on demand",
                                                   **GREEDY)
                assert result.choices[0].token_ids == _expected(adapters[name][1], tiny_model,
                                                                prompt_ids), name
            assert [c.id for c in client.models.list().data] == ["tiny", "all", "qv"]
            for name in ("../resolver", "all/..", "missing", ".hidden"):
                with pytest.raises(openai.NotFoundError):
                    client.completions.create(model=name, prompt="x", max_tokens=1)
            with pytest.raises(openai.BadRequestError, match='"peft_type": "LORA"'):
                client.completions.create(model="broken", prompt="x", max_tokens=1)
            # It did not load: not listed as a model.
            assert [c.id for c in client.models.list().data] == ["tiny", "all", "qv"]
    finally:
        server.stop()
