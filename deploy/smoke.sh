#!/usr/bin/env bash
# Runs a built CPU image as a user would, and fails (exit 1) at the first thing that does not work:
#   deploy/smoke.sh IMAGE            (ENGINE=podman|docker; default: whichever exists)
# 1. exports the zoo's SSA model into a volume with the image's own sharp-export;
# 2. serves it read-only root, non-root (10001), every capability dropped, no new privileges, with the HTTP API on;
# 3. checks, from a second container of the same image: grpc.health Check and Watch (SERVING), a generation with
#    per-head stats, the Prometheus page, an OpenAI completion and GET /health on the HTTP port;
# 4. SIGTERM: the server drains and exits 0.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: deploy/smoke.sh IMAGE  (ENGINE=podman|docker)" >&2; exit 2; }
image=$1
engine=${ENGINE:-$(command -v docker || command -v podman || true)}
[ -n "$engine" ] || { echo "smoke.sh: needs docker or podman" >&2; exit 2; }
name=sharp-smoke-$$
models=$(mktemp -d)
chmod 0777 "$models"
cleanup() { "$engine" rm -f "$name" >/dev/null 2>&1 || true; rm -rf "$models"; }
trap cleanup EXIT
fail() { echo "smoke.sh: FAILED: $*" >&2; "$engine" logs "$name" 2>&1 | tail -20 >&2 || true; exit 1; }
ports=$(python3 -c 'import socket
s=[socket.socket() for _ in range(4)]
[x.bind(("127.0.0.1", 0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))')
read -r grpc_port health_port metrics_port http_port <<<"$ports"
hardened=(--read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges --user 10001:10001 --network host)

echo "1. export the zoo's SSA model into the volume"
"$engine" run --rm "${hardened[@]}" -v "$models:/models" --entrypoint python "$image" -P -c '
import sys
from sharp.exporter.cli import main
from sharp.models.checkpoint import zoo_model
sys.exit(main([str(zoo_model("ssa")), "-o", "/models/model.onnx"]))' || fail "export"

echo "2. serve (read-only root, uid 10001, no capabilities)"
"$engine" run -d --name "$name" "${hardened[@]}" -v "$models:/models:ro" "$image" /models/model.onnx \
    --host 127.0.0.1 --port "$grpc_port" --health-port "$health_port" --metrics-port "$metrics_port" \
    --http-port "$http_port" >/dev/null || fail "start"

echo "3. health (Check, Watch), a generation, metrics, the OpenAI API"
"$engine" run --rm --network host --read-only --cap-drop ALL --user 10001:10001 --entrypoint python "$image" -P -c '
import json, sys, time, urllib.request
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sharp.serving import Client
grpc_port, health_port, metrics_port, http_port = sys.argv[1:5]
deadline = time.time() + 120
channel = grpc.insecure_channel(f"127.0.0.1:{health_port}")
stub = health_pb2_grpc.HealthStub(channel)
while True:
    try:
        if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
            break
    except grpc.RpcError:
        pass
    if time.time() > deadline:
        sys.exit("health never reported SERVING")
    time.sleep(0.5)
watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)
assert next(watch).status == health_pb2.HealthCheckResponse.SERVING, "Watch"
watch.cancel()
with Client(f"127.0.0.1:{grpc_port}") as c:
    r = c.generate("def main():", max_new_tokens=8, temperature=0, attention_stats=True)
    assert r.usage.completion_tokens >= 1 and len(r.attention_stats.heads) == 16, r
print("   generated", repr(r.text))
page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
assert "sharp_requests_total" in page and "sharp_attention_entropy_nats" in page, "metrics"
body = json.dumps({"model": "model", "prompt": "x = ", "max_tokens": 4, "temperature": 0}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                             {"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=30))
assert out["usage"]["completion_tokens"] >= 1, out
assert urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10).status == 200
print("   OpenAI completion", repr(out["choices"][0]["text"]))
' "$grpc_port" "$health_port" "$metrics_port" "$http_port" || fail "checks"

echo "4. SIGTERM: drain and exit 0"
"$engine" stop -t 60 "$name" >/dev/null
code=$("$engine" inspect --format '{{.State.ExitCode}}' "$name")
[ "$code" = 0 ] || fail "exit status $code after SIGTERM"
echo "smoke.sh: passed ($image)"
