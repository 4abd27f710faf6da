"""Python wrapper around test/mock/mock_cluster (librdkafka mock cluster).

Standard library only (Debian's /usr/bin/python3).

    from mockcluster import MockCluster
    with MockCluster(brokers=3, topics={"outbox.events": 4}) as mc:
        print(mc.bootstrap)                 # "127.0.0.1:p1,127.0.0.1:p2,..."
        mc.push_errors("Produce", "NOT_ENOUGH_REPLICAS", "_TRANSPORT")
        mc.down("all"); ...; mc.up("all")
        mc.leader("outbox.events", 0, 2)

Every method sends one command line and raises MockClusterError on "ERR ...".
Build the binary first: make -C test/mock
"""

import os
import subprocess
import threading

__all__ = ["MockCluster", "MockClusterError", "DEFAULT_BINARY"]

DEFAULT_BINARY = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "mock_cluster")


class MockClusterError(RuntimeError):
    pass


class MockCluster:
    def __init__(self, brokers=3, topics=None, binary=None, debug=None,
                 stderr=None, start_timeout=10.0):
        """Start the mock cluster process.

        topics: dict {name: partitions} or iterable of (name, partitions) or
        (name, partitions, replication_factor).
        stderr: passed to subprocess.Popen (default: inherit).
        """
        self.binary = binary or DEFAULT_BINARY
        self.brokers = int(brokers)
        args = [self.binary, "--brokers", str(self.brokers)]
        if topics:
            items = topics.items() if isinstance(topics, dict) else topics
            for t in items:
                args += ["--topic", ":".join(str(x) for x in t)]
        if debug:
            args += ["--debug", debug]
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=stderr, text=True, bufsize=1)
        line = self._readline(start_timeout)
        if not line.startswith("BOOTSTRAP "):
            self.proc.kill()
            self.proc.wait()
            raise MockClusterError(
                "mock_cluster did not start (rc=%s, got %r)"
                % (self.proc.returncode, line))
        self.bootstrap = line.split(" ", 1)[1].strip()

    def _readline(self, timeout):
        # readline() on a pipe has no timeout; use a helper thread.
        result = []
        t = threading.Thread(
            target=lambda: result.append(self.proc.stdout.readline()),
            daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise MockClusterError("timeout waiting for mock_cluster")
        return result[0] if result else ""

    def command(self, *words, timeout=10.0):
        """Send one command line; return None on OK, raise on ERR."""
        line = " ".join(str(w) for w in words)
        if "\n" in line:
            raise ValueError("newline in command")
        with self._lock:
            if self.proc is None:
                raise MockClusterError("mock_cluster is closed")
            if self.proc.poll() is not None:
                raise MockClusterError(
                    "mock_cluster has exited (rc=%s)" % self.proc.returncode)
            try:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise MockClusterError("mock_cluster has exited")
            reply = self._readline(timeout).rstrip("\n")
        if reply == "OK":
            return None
        if reply.startswith("ERR"):
            raise MockClusterError("%s: %s" % (line, reply[4:]))
        raise MockClusterError("%s: unexpected reply %r" % (line, reply))

    # --- commands -------------------------------------------------------

    def create_topic(self, name, partitions, replication_factor=None):
        if replication_factor is None:
            self.command("topic", name, partitions)
        else:
            self.command("topic", name, partitions, replication_factor)

    def down(self, broker):
        """broker: id (1..N) or 'all'."""
        self.command("down", broker)

    def up(self, broker):
        self.command("up", broker)

    def rtt(self, broker, ms):
        self.command("rtt", broker, int(ms))

    def push_errors(self, apikey, *errors):
        """Next len(errors) requests of ApiKey (name or number), on any
        broker, fail with these errors in order ('_TRANSPORT' disconnects)."""
        if not errors:
            raise ValueError("no errors given")
        self.command("err", apikey, len(errors), *errors)

    def clear_errors(self, apikey):
        self.command("clearerr", apikey)

    def broker_errors(self, broker, apikey, errors_rtts):
        """errors_rtts: iterable of (errname, rtt_ms) or bare errnames."""
        items = []
        for e in errors_rtts:
            if isinstance(e, (tuple, list)):
                items.append("%s:%d" % (e[0], int(e[1])))
            else:
                items.append(str(e))
        if not items:
            raise ValueError("no errors given")
        self.command("brokererr", broker, apikey, *items)

    def leader(self, topic, partition, broker):
        """broker -1 makes the partition leaderless."""
        self.command("leader", topic, partition, broker)

    def follower(self, topic, partition, broker):
        self.command("follower", topic, partition, broker)

    def topic_error(self, topic, err):
        """err 'NO_ERROR' clears it."""
        self.command("topicerr", topic, err)

    def ping(self):
        self.command("ping")

    def close(self, timeout=10.0):
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            if proc.poll() is None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.flush()
                except (BrokenPipeError, ValueError):
                    pass
            try:
                proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(2)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
