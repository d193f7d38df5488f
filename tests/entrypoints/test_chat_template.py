"""`kvtier serve --chat-template`: chats render with the given template, and a router that
follows the server hashes chat prompts with it too; a template's own error is a 400."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvtier.models.tokenizer import Tokenizer
from kvtier.router.config import RouterConfig
from kvtier.router.prompts import CHAT_PATH
from kvtier.router.service import RouterService

from .server_process import ServerProcess, free_port

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ raise_exception('this model takes no system messages') }}{% endif %}"
            "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")


def test_chats_render_with_the_given_template_here_and_in_the_router(tiny_model, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    server = ServerProcess(tiny_model[0], "--chat-template", str(path), "--block-size", "16",
                           "--num-device-blocks", "64", "--kv-events-config", json.dumps(events))
    try:
        body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2,
                "return_token_ids": True}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60.0)
        tokenizer = Tokenizer.from_hf_dir(tiny_model[0])
        expected = tokenizer.encode("[user] Hello there\n[assistant]", add_special_tokens=False)
        assert answer.json()["prompt_token_ids"] == expected
        info = httpx.get(f"{server.url}/v1/kv_events_info", timeout=10.0).json()
        assert info["chat_template"] == TEMPLATE
        # The publisher's losses are served with the engine's metrics.
        metrics = httpx.get(f"{server.url}/metrics", timeout=10.0).text
        assert 'kvtier:kv_events_lost_batches_total{cause="queue_full",engine="0"' in metrics

        async def router_token_ids() -> list[int] | None:
            service = RouterService(RouterConfig(instances=(server.url,)))
            try:
                await service.check(service.instances[0])
                return service.hasher.token_ids(CHAT_PATH, body)
            finally:
                await service.stop()

        assert asyncio.run(router_token_ids()) == expected
        system = {"messages": [{"role": "system", "content": "Be brief"}], "max_tokens": 2}
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=system, timeout=60.0)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["message"], error["param"]) == (
            "chat template failed to render: this model takes no system messages", "messages")
    finally:
        server.stop()
