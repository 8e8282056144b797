"""A stand-in for a vLLM server, for launcher tests: parses --port, answers /health.

Behaviour knobs by environment: STUB_FAIL=1 prints an error and exits 1 at startup;
STUB_CHILD=1 forks a grandchild (like vLLM's engine core) that writes its pid to
$STUB_PID_DIR, so tests can check that the whole process group goes away; with
$STUB_PID_DIR set it also leaves a file in its temp dir (as vLLM leaves its ZMQ sockets and
``vllm_dist_*`` files) and writes that file's path to $STUB_PID_DIR/tmp-<pid>.
"""

import argparse
import http.server
import os
import subprocess
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
args, _ = ap.parse_known_args()

if os.environ.get("STUB_FAIL") == "1":
    print("stub: simulated startup failure: CUDA out of memory", flush=True)
    sys.exit(1)

pid_dir = os.environ.get("STUB_PID_DIR")
if pid_dir:
    with open(os.path.join(pid_dir, f"server-{os.getpid()}"), "w") as f:
        f.write(str(os.getpid()))
if pid_dir:
    left = os.path.join(tempfile.gettempdir(), f"vllm_dist_stub{os.getpid()}")
    with open(left, "w") as f:
        f.write("rendezvous")
    with open(os.path.join(pid_dir, f"tmp-{os.getpid()}"), "w") as f:
        f.write(left)
if os.environ.get("STUB_CHILD") == "1" and pid_dir:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(pid_dir, f"child-{child.pid}"), "w") as f:
        f.write(str(child.pid))


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a: object) -> None:
        pass


time.sleep(float(os.environ.get("STUB_DELAY_S", "0")))
print(f"stub: serving on {args.port}", flush=True)
http.server.HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
