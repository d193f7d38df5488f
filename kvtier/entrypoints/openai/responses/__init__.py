"""OpenAI's Responses API (`/v1/responses`) on top of the chat path.

A Responses request becomes a chat request: `instructions` a system message, the `input` items
messages (function calls and their outputs as the chat's tool calls and tool messages), and,
with `previous_response_id`, the stored conversation before them. The answer becomes output
items (reasoning, message, function calls) and, streamed, OpenAI's typed events. Responses are
kept in a bounded in-memory store on the instance that made them, so a conversation can go on
by id: its earlier turns render to the same prompt prefix, whose KV the prefix cache and the
tiers hold.
"""
