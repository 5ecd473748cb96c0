#!/usr/bin/env bash
# Ray Serve's HAProxy, started on the config Serve generated plus `option http-buffer-request`.
#
# Why: HAProxy can resend a request to another ingress replica when the one it chose closes
# without answering (a replica killed as the request arrived; RAY_SERVE_HAPROXY_RETRY_ON's
# empty-response) only if the whole request was in its buffer when it first forwarded it.
# Clients send the headers and the body of a POST in separate writes (requests, httpx and so
# the OpenAI SDK), so HAProxy often forwarded the headers alone and the retry was off: the
# client got a 500. Buffering waits for the body (a few hundred bytes of JSON) before
# connecting. Serve runs this as `BINARY -db -f CONFIG [-sf PIDS...]`, once per start or
# reload; the config copy sits next to Serve's, which stays as Serve wrote it.
set -euo pipefail
binary="${LLM_CLUSTER_HAPROXY_BINARY:?the haproxy binary this wraps (actors/env.py sets it)}"
args=()
while (($#)); do
    if [[ $1 == -f && $# -ge 2 ]]; then
        copy="${2%.cfg}.buffered.cfg"
        sed 's/^defaults$/defaults\n    option http-buffer-request/' "$2" > "$copy.$$"
        grep -q '^    option http-buffer-request$' "$copy.$$" || { echo "no defaults section in $2" >&2; exit 1; }
        mv "$copy.$$" "$copy"
        args+=(-f "$copy")
        shift 2
    else
        args+=("$1")
        shift
    fi
done
exec "$binary" "${args[@]}"
