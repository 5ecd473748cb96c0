"""The HTTP surface: the OpenAI-compatible `ingress` deployment, from the request body to the
engine calls and back.

- `ingress`: the FastAPI routes (auth, parsing, chat template, tokenization, entry checks).
- `served`: the models one ingress serves (per model: config, tokenizer, entry checks, engine
  streams, metrics) and the lookup of a request's `model` (404 `model_not_found`).
- `openai_protocol`: request models -> SamplingParams; `OpenAIError`.
- `chat_parsers` (with `reasoning_parser`, `tool_parser`): chat text -> reasoning, content,
  tool calls.
- `streams`: a request's engine streams (opened through actors/channel/): detokenize, stop
  strings, abort, SSE or JSON.
- `openai_format`: response bodies and stream chunks.
- `responses` (request, onto the chat path), `responses_format` (the response object and its
  events), `responses_api` (the routes' work, with the store in actors/store/): the Responses API.
- `openapi`, `body_limit`: the published schema, the request body limit.
"""
