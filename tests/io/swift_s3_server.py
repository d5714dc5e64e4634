#!/usr/bin/python3
"""A real S3-compatible server for the bucket tests: OpenStack Swift (Debian 12's swift-proxy,
swift-account, swift-container, swift-object) with its s3api middleware and tempauth, one
replica, every file in a temporary directory that is removed on exit.

Usage: swift_s3_server.py [--bucket NAME]... [--start-timeout S]
       swift_s3_server.py --daemon STATE [--bucket NAME]...   (ctest's FIXTURES_SETUP)
       swift_s3_server.py --stop STATE                          (ctest's FIXTURES_CLEANUP)

Once every server answers (polled, bounded by --start-timeout) and the buckets exist, it prints
one JSON line: {"endpoint", "region", "access_key", "secret_key", "other_access_key",
"other_secret_key", "reader_access_key", "reader_secret_key", "buckets"}. "other" is a user of another account, who does not see the
buckets; "reader" a user of their account without the admin group, who is denied access. Then it reads commands, one a line, answering each with one line:
  stop [SERVER]   stops the proxy (the S3 endpoint), or the account, container or object
                  server; answers "stopped" once it has exited
  start [SERVER]  starts it again on the same port; answers "started" once every server
                  answers
End of input, SIGTERM or SIGINT stops every server and removes the directory. Each server is
started with PR_SET_PDEATHSIG, so a fixture that is killed takes its servers with it.

With --daemon, the server detaches once ready, writes that JSON line (with its "pid") to STATE
and the command exits; --stop STATE ends it (bounded wait) and removes STATE. Tests share one
such server through ctest's fixtures (s3_test_server.h); a daemon ends by itself after
--max-lifetime seconds, so an interrupted ctest leaves nothing running for long.

Exits 77 (ctest's skip code) naming what is missing when Debian's Swift is not installed.
"""

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SKIP = 77
USER, KEY = "test:tester", "testing"
OTHER_USER, OTHER_KEY = "other:viewer", "viewing"
# A user of the buckets' account without the admin group: denied access to its buckets.
READER_USER, READER_KEY = "test:reader", "reading"

# A dict for the proxy's "swift.cache": tempauth requires a cache, and a memcached server would
# be one more process and port. Lives in the temporary directory, on the proxy's PYTHONPATH.
CACHE_MODULE = '''
import time
class Cache:
    def __init__(self):
        self.values = {}
    def get(self, key, **kwargs):
        entry = self.values.get(key)
        if entry is None or (entry[1] and entry[1] < time.time()):
            return None
        return entry[0]
    def set(self, key, value, serialize=True, time=0, **kwargs):
        import time as clock
        self.values[key] = (value, clock.time() + time if time else 0)
    def incr(self, key, delta=1, time=0, **kwargs):
        value = (self.get(key) or 0) + delta
        self.set(key, value, time=time)
        return value
    def decr(self, key, delta=1, time=0, **kwargs):
        return self.incr(key, -delta, time)
    def delete(self, key, **kwargs):
        self.values.pop(key, None)
    def get_multi(self, keys, server_key, **kwargs):
        return [self.get(key) for key in keys]
    def set_multi(self, mapping, server_key, time=0, **kwargs):
        for key, value in mapping.items():
            self.set(key, value, time=time)
def filter_factory(global_conf, **local_conf):
    cache = Cache()
    def make(app):
        def middleware(env, start_response):
            env['swift.cache'] = cache
            return app(env, start_response)
        return middleware
    return make
'''

# Runs one server with this directory's swift.conf instead of /etc/swift/swift.conf. eventlet's
# listen() sets SO_REUSEPORT, under which a server whose port another process took after
# free_port() chose it would share that port (each connection going to either); without it the
# bind fails, the server exits ("Could not bind"), and the fixture starts over on other ports.
LAUNCHER = '''
import functools
import sys
import eventlet
import swift.common.wsgi as swift_wsgi
swift_wsgi.listen = functools.partial(eventlet.listen, reuse_port=False)
import swift.common.utils as utils
utils.SWIFT_CONF_FILE = sys.argv[3]
from swift.common import constraints, storage_policy
storage_policy.reload_storage_policies()
constraints.reload_constraints()
from swift.common.wsgi import run_wsgi
kwargs = {}
if sys.argv[1] == "object-server":
    from swift.obj import server
    kwargs["global_conf_callback"] = server.global_conf_callback
sys.exit(run_wsgi(sys.argv[2], sys.argv[1], **kwargs))
'''


class PortTaken(RuntimeError):
    """A server could not bind its port: another process holds it."""


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Swift:
    SERVERS = ("account", "container", "object", "proxy")

    def __init__(self, root):
        self.root = root
        self.processes = {}
        os.makedirs(os.path.join(root, "srv", "d0"))
        with open(os.path.join(root, "pulseloco_swift_cache.py"), "w") as f:
            f.write(CACHE_MODULE)
        with open(os.path.join(root, "launch.py"), "w") as f:
            f.write(LAUNCHER)
        self.choose_ports()

    def choose_ports(self):
        self.ports = {name: free_port() for name in self.SERVERS}
        self.write_configs()
        self.build_rings()

    def start_all(self, deadline, buckets, attempts=5):
        """Starts every server and waits until they are ready. A server that could not bind its
        port (another process took it after free_port() chose it) makes them all start again on
        other ports, up to `attempts` times."""
        for attempt in range(1, attempts + 1):
            for name in self.SERVERS:
                self.start(name)
            try:
                self.wait_ready(deadline, buckets)
                return
            except PortTaken:
                self.stop_all()
                if attempt == attempts:
                    raise
                self.choose_ports()

    def write_configs(self):
        root = self.root
        with open(os.path.join(root, "swift.conf"), "w") as f:
            f.write("[swift-hash]\nswift_hash_path_suffix = pulseloco\n"
                    "swift_hash_path_prefix = pulseloco\n"
                    "[storage-policy:0]\nname = gold\ndefault = yes\n")
        # bind_timeout: a port that is taken fails the bind soon (the default waits 30 s).
        common = (f"swift_dir = {root}\ndevices = {root}/srv\nmount_check = false\n"
                  "bind_ip = 127.0.0.1\nbind_timeout = 2\nworkers = 0\nlog_level = WARNING\n")
        for name in ("account", "container", "object"):
            with open(os.path.join(root, f"{name}-server.conf"), "w") as f:
                f.write(f"[DEFAULT]\n{common}bind_port = {self.ports[name]}\n"
                        f"[pipeline:main]\npipeline = {name}-server\n"
                        f"[app:{name}-server]\nuse = egg:swift#{name}\n")
        filters = "".join(f"[filter:{name}]\nuse = egg:swift#{name.replace('-', '_')}\n"
                          for name in ("catch_errors", "gatekeeper", "healthcheck",
                                       "proxy-logging", "listing_formats", "copy", "slo", "dlo"))
        with open(os.path.join(root, "proxy-server.conf"), "w") as f:
            f.write(f"""[DEFAULT]
{common}bind_port = {self.ports['proxy']}
[pipeline:main]
pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth copy slo dlo proxy-logging proxy-server
[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true
allow_account_management = true
# A backend server the tests stop and start is used again as soon as it answers (by default the
# proxy leaves a failed node alone for 60 s).
error_suppression_limit = 1000000
[filter:cache]
paste.filter_factory = pulseloco_swift_cache:filter_factory
[filter:tempauth]
use = egg:swift#tempauth
user_test_tester = {KEY} .admin
user_other_viewer = {OTHER_KEY} .admin
user_test_reader = {READER_KEY}
[filter:s3api]
use = egg:swift#s3api
location = us-east-1
# Multipart uploads with small parts, so that tests need no large files.
min_segment_size = 1
{filters}""")

    def build_rings(self):
        from swift.common.ring import RingBuilder
        for name in ("account", "container", "object"):
            builder = RingBuilder(4, 1, 1)
            builder.add_dev({"id": 0, "region": 1, "zone": 1, "ip": "127.0.0.1",
                             "port": self.ports[name], "device": "d0", "weight": 100,
                             "meta": ""})
            builder.rebalance()
            builder.get_ring().save(os.path.join(self.root, f"{name}.ring.gz"))

    def start(self, name):
        env = dict(os.environ, PYTHONPATH=self.root)
        log = open(os.path.join(self.root, f"{name}.log"), "ab")
        self.processes[name] = subprocess.Popen(
            ["/usr/bin/python3", os.path.join(self.root, "launch.py"), f"{name}-server",
             os.path.join(self.root, f"{name}-server.conf"),
             os.path.join(self.root, "swift.conf")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
            preexec_fn=die_with_parent)
        log.close()

    def stop(self, name):
        process = self.processes.pop(name, None)
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def stop_all(self):
        for name in list(self.processes):
            self.stop(name)

    def check_running(self):
        for name, process in self.processes.items():
            if process.poll() is not None:
                with open(os.path.join(self.root, f"{name}.log"), errors="replace") as f:
                    log = f.read()[-4000:]
                error = PortTaken if "Could not bind" in log else RuntimeError
                raise error(f"swift {name} server exited ({process.returncode}):\n{log}")

    def swift_request(self, method, path, headers=None):
        url = f"http://127.0.0.1:{self.ports['proxy']}{path}"
        request = urllib.request.Request(url, method=method, headers=headers or {},
                                         data=b"" if method == "PUT" else None)
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers)

    def wait_ready(self, deadline, buckets=()):
        """Polls until the proxy authenticates and a container and an object can be written
        (which needs all four servers), then creates the buckets."""
        last = None
        while True:
            self.check_running()
            try:
                _, headers = self.swift_request(
                    "GET", "/auth/v1.0", {"X-Auth-User": USER, "X-Auth-Key": KEY})
                token = {"X-Auth-Token": headers["X-Auth-Token"]}
                account = headers["X-Storage-Url"].split("/v1/", 1)[1]
                self.swift_request("PUT", f"/v1/{account}/pulseloco-probe", token)
                self.swift_request("PUT", f"/v1/{account}/pulseloco-probe/probe", token)
                for bucket in buckets:
                    self.swift_request("PUT", f"/v1/{account}/{bucket}", token)
                return
            except (OSError, urllib.error.URLError, KeyError) as error:
                last = error
            if time.monotonic() > deadline:
                raise RuntimeError(f"swift did not become ready: {last}")
            time.sleep(0.05)  # a poll interval: readiness is observed, not assumed


def stop_daemon(state):
    try:
        with open(state) as f:
            pid = json.loads(f.readline())["pid"]
    except (OSError, ValueError, KeyError):
        return 0  # nothing was started (a skipped or failed setup)
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            os.kill(pid, 0)  # raises once it is gone
            time.sleep(0.05)  # polls the exit, bounded by the deadline
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.unlink(state)
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", action="append", default=[])
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--daemon", metavar="STATE")
    parser.add_argument("--stop", metavar="STATE")
    parser.add_argument("--max-lifetime", type=float, default=3 * 3600.0)
    args = parser.parse_args()
    if args.stop:
        return stop_daemon(args.stop)
    try:
        import swift.common.ring  # noqa: F401
        import swift.common.middleware.s3api  # noqa: F401
    except ImportError as error:
        line = (f"SKIP: Debian's OpenStack Swift is not installed ({error}); scripts/deps "
                "installs swift-proxy swift-account swift-container swift-object python3-swift")
        print(line, flush=True)
        if args.daemon:
            with open(args.daemon, "w") as f:  # the tests that share it skip, saying why
                f.write(line + "\n")
            return 0
        return SKIP
    ready_write = None
    if args.daemon:
        ready_read, ready_write = os.pipe()
        if os.fork() != 0:
            # The parent: waits for the daemon's first line, records it, and exits.
            os.close(ready_write)
            with os.fdopen(ready_read) as ready:
                line = ready.readline()
            if not line.startswith("{"):
                print(f"the S3 server did not start: {line.strip()}", flush=True)
                return 1
            with open(args.daemon + ".tmp", "w") as f:
                f.write(line)
            os.replace(args.daemon + ".tmp", args.daemon)
            print(line.strip(), flush=True)
            return 0
        os.close(ready_read)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        signal.signal(signal.SIGALRM, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
        signal.alarm(int(args.max_lifetime))
    root = tempfile.mkdtemp(prefix="pulseloco-swift-")
    swift = None

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        swift = Swift(root)
        swift.start_all(time.monotonic() + args.start_timeout, args.bucket)
        info = json.dumps({
            "endpoint": f"http://127.0.0.1:{swift.ports['proxy']}",
            "region": "us-east-1",
            "access_key": USER, "secret_key": KEY,
            "other_access_key": OTHER_USER, "other_secret_key": OTHER_KEY,
            "reader_access_key": READER_USER, "reader_secret_key": READER_KEY,
            "buckets": args.bucket, "pid": os.getpid()})
        if ready_write is not None:
            os.write(ready_write, (info + "\n").encode())
            os.close(ready_write)
            ready_write = None
            while True:
                signal.pause()  # until SIGTERM (--stop) or the lifetime's alarm
        print(info, flush=True)
        for line in sys.stdin:
            command, _, name = line.strip().partition(" ")
            name = name or "proxy"
            if command == "stop" and name in swift.ports:
                swift.stop(name)
                print("stopped", flush=True)
            elif command == "start" and name in swift.ports:
                swift.start(name)
                swift.wait_ready(time.monotonic() + args.start_timeout)
                print("started", flush=True)
            elif command:
                print(f"unknown command '{line.strip()}'", flush=True)
        return 0
    except Exception as error:
        if ready_write is None:
            raise
        os.write(ready_write, f"error: {error}\n".encode())
        return 1
    finally:
        if swift is not None:
            swift.stop_all()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
