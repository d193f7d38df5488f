"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the chat path.

A Messages request becomes a chat request: `system` a first system message, `tool_use` blocks
the assistant's tool calls and `tool_result` blocks tool messages, a final assistant message the
start of the answer. The answer comes back as content blocks (thinking, text, tool_use) and,
streamed, as Anthropic's typed events. Errors on these paths take Anthropic's shape (see
kvtier/entrypoints/openai/errors.py). Coding agents resend their whole growing conversation
every turn: its earlier turns render to the same prompt prefix, whose KV the prefix cache and
the tiers hold.
"""
