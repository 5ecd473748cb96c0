"""The HTTP surface: the OpenAI-compatible `ingress` deployment, from the request body to the
engine calls and back.

- `ingress`: the FastAPI routes (auth, parsing, chat template, tokenization, entry checks).
- `openai_protocol`: request models -> SamplingParams; `OpenAIError`.
- `chat_parsers` (with `reasoning_parser`, `tool_parser`): chat text -> reasoning, content,
  tool calls.
- `streams`: a request's engine streams: send, follow, detokenize, stop strings, abort, SSE or JSON.
- `openai_format`: response bodies and stream chunks.
- `openapi`, `body_limit`: the published schema, the request body limit.
"""
