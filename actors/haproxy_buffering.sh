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
#
# A freshly started HAProxy (Serve's first spawn, then after its manager was replaced) runs
# for about half a second on a config with no application backends before Serve reloads it with
# them; Ray's template answers 404 "Path not found" then, which clients take as final. Until a
# config has routes, that answer is a 503 with Retry-After instead.
#
# HAProxy dies with the process that started it (Serve's HAProxyManager actor): setpriv's
# --pdeathsig (util-linux) asks Linux to send it SIGTERM, on which HAProxy stops at once. Without
# it, a manager killed with its node's Ray left HAProxy holding the HTTP port, and the next
# `serve run` came up broken behind it. Where setpriv is missing HAProxy is started plainly.
#
# Also: Ray's template binds HAProxy's stats (8404) and Prometheus (9101) listeners to every
# interface whatever host Serve's HTTP listener was given. When that listener binds a loopback
# address (tests, `make serve`), the copy binds those two there too; otherwise they stay as
# Ray wrote them (a metrics scraper on another host reaches them).
set -euo pipefail
# HAProxy's answer while its config has no application routes, as an OpenAI error (HTTP 503).
not_ready='http-request return status 503 content-type application/json hdr retry-after 1 string "{\\"error\\":{\\"message\\":\\"the server is starting: its routes are not loaded yet; retry\\",\\"type\\":\\"ServiceUnavailableError\\",\\"param\\":null,\\"code\\":503}}"'
binary="${LLM_CLUSTER_HAPROXY_BINARY:?the haproxy binary this wraps (actors/env.py sets it)}"
args=()
while (($#)); do
    if [[ $1 == -f && $# -ge 2 ]]; then
        copy="${2%.cfg}.buffered.cfg"
        sed 's/^defaults$/defaults\n    option http-buffer-request/' "$2" > "$copy.$$"
        grep -q '^    option http-buffer-request$' "$copy.$$" || { echo "no defaults section in $2" >&2; exit 1; }
        if ! grep -q '^ *use_backend ' "$2"; then  # no application routes yet: see the header
            sed -i -E "s|^( *)http-request return status 404 .*not found.*$|\1$not_ready|" "$copy.$$"
        fi
        loopback=$(sed -nE 's/^ *bind (127\.[0-9.]+):[0-9]+$/\1/p' "$2" | sed -n 1p)
        if [[ -n $loopback ]]; then
            sed -i -E "s/^( *bind )(\*|0\.0\.0\.0)?:([0-9]+)$/\1$loopback:\3/" "$copy.$$"
        fi
        mv "$copy.$$" "$copy"
        args+=(-f "$copy")
        shift 2
    else
        args+=("$1")
        shift
    fi
done
if command -v setpriv >/dev/null && setpriv --pdeathsig TERM true 2>/dev/null; then
    exec setpriv --pdeathsig TERM "$binary" "${args[@]}"
fi
exec "$binary" "${args[@]}"
