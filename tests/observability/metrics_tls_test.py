#!/usr/bin/python3
"""The metrics endpoint over HTTPS with HTTP basic auth, scraped by a real
Prometheus.

Starts fulcrum-coordinator with --metrics_tls_cert_file/--metrics_tls_key_file
(a certificate from deploy/tls/gen-certs.sh) and --metrics_basic_auth_file (a
bcrypt hash made with Python's crypt), then checks:

  - /metrics without credentials and with a wrong password: 401 with
    WWW-Authenticate; with the right password: 200 and fulcrum_build_info;
    /healthz: 200 without credentials (for probes);
  - plain HTTP to the port gets no answer; a client that does not trust the
    CA fails the handshake;
  - a changed password file is picked up without a restart;
  - the Debian prometheus with scheme https, tls_config and basic_auth
    scrapes it (up == 1, fulcrum_build_info present), while a job without
    credentials sees 401 (up == 0).

Usage: metrics_tls_test.py SOURCE_DIR BUILD_DIR
"""
import base64
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)  # crypt: fine in Debian 12's Python 3.11
import crypt  # noqa: E402
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

SRC, BUILD = sys.argv[1], sys.argv[2]
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def free_port():
    """A free port below the ephemeral range (tests/testing/free_ports.py)."""
    sys.path.insert(0, os.path.join(SRC, "tests", "testing"))
    from free_ports import free_block  # pylint: disable=import-outside-toplevel
    return free_block(1)


def get(url, ctx=None, user=None, password=None):
    """(status, body, headers) of a GET; status -1 with the error for a failed connection."""
    req = urllib.request.Request(url)
    if user is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)
    except Exception as e:  # connection reset, TLS failure, bad status line
        return -1, repr(e), {}


def write_htpasswd(path, user, password):
    with open(path, "w") as f:
        f.write(f"# users allowed to scrape\n{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")


def main():
    work = tempfile.mkdtemp(prefix="fulcrum-metrics-tls-")
    pki = os.path.join(work, "pki")
    subprocess.run([os.path.join(SRC, "deploy/tls/gen-certs.sh"), pki, "--servers", "0", "--workers", "0"],
                   check=True, capture_output=True)
    auth = os.path.join(work, "htpasswd")
    write_htpasswd(auth, "prometheus", "first-password")
    port = free_port()
    log_path = os.path.join(work, "coordinator.log")
    coord = subprocess.Popen(
        [os.path.join(BUILD, "server/fulcrum-coordinator"), "--insecure", "--listen=127.0.0.1:0",
         f"--data_dir={os.path.join(work, 'coord')}", f"--metrics_addr=127.0.0.1:{port}",
         f"--metrics_tls_cert_file={pki}/coordinator.crt", f"--metrics_tls_key_file={pki}/coordinator.key",
         f"--metrics_basic_auth_file={auth}"],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    prom = None
    try:
        for _ in range(100):
            if "metrics on https://" in open(log_path).read():
                break
            time.sleep(0.1)
        log = open(log_path).read()
        check(f"metrics on https://127.0.0.1:{port}/metrics (basic auth)" in log, "the coordinator logs its HTTPS endpoint")

        url = f"https://127.0.0.1:{port}"
        ctx = ssl.create_default_context(cafile=f"{pki}/ca.crt")
        status, body, headers = get(url + "/metrics", ctx)
        check(status == 401 and headers.get("WWW-Authenticate", "").startswith("Basic"),
              f"no credentials: 401 with WWW-Authenticate ({status} {headers.get('WWW-Authenticate')})")
        status, _, _ = get(url + "/metrics", ctx, "prometheus", "wrong")
        check(status == 401, f"wrong password: 401 ({status})")
        status, _, _ = get(url + "/metrics", ctx, "someone", "first-password")
        check(status == 401, f"unknown user: 401 ({status})")
        status, body, _ = get(url + "/metrics", ctx, "prometheus", "first-password")
        check(status == 200 and 'fulcrum_build_info{component="coordinator"' in body,
              f"right password: 200 with fulcrum_build_info ({status})")
        status, body, _ = get(url + "/healthz", ctx)
        check(status == 200 and body == "ok\n", f"/healthz needs no credentials ({status})")
        status, err, _ = get(f"http://127.0.0.1:{port}/metrics")
        check(status == -1, f"plain HTTP gets no answer ({err[:80]})")
        status, err, _ = get(url + "/metrics", ssl.create_default_context(), "prometheus", "first-password")
        check(status == -1 and "CERTIFICATE_VERIFY_FAILED" in err, f"a client without the CA fails the handshake ({err[:80]})")

        # Rotation of the password file.
        time.sleep(0.05)
        write_htpasswd(auth, "prometheus", "second-password")
        status, _, _ = get(url + "/metrics", ctx, "prometheus", "first-password")
        check(status == 401, f"old password refused after the file changed ({status})")
        status, _, _ = get(url + "/metrics", ctx, "prometheus", "second-password")
        check(status == 200, f"new password accepted without a restart ({status})")

        # A real Prometheus.
        with open(os.path.join(work, "password"), "w") as f:
            f.write("second-password")
        cfg = os.path.join(work, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write(f"""global: {{scrape_interval: 1s, scrape_timeout: 1s}}
scrape_configs:
  - job_name: secured
    scheme: https
    tls_config: {{ca_file: {pki}/ca.crt}}
    basic_auth: {{username: prometheus, password_file: {work}/password}}
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
  - job_name: no-credentials
    scheme: https
    tls_config: {{ca_file: {pki}/ca.crt}}
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
""")
        r = subprocess.run(["promtool", "check", "config", cfg], capture_output=True, text=True)
        check(r.returncode == 0, f"promtool check config: {r.stdout.strip()[-200:]} {r.stderr.strip()[-200:]}")
        prom_port = free_port()
        prom = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={work}/tsdb",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=open(os.path.join(work, "prometheus.log"), "w"), stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        health = {}
        deadline = time.time() + 60
        while time.time() < deadline:
            status, body, _ = get(api + "/targets")
            if status == 200:
                targets = json.loads(body)["data"]["activeTargets"]
                health = {t["labels"]["job"]: (t["health"], t.get("lastError", "")) for t in targets}
                if all(h[0] != "unknown" for h in health.values()) and len(health) == 2:
                    break
            time.sleep(0.5)
        print("targets:", health, flush=True)
        check(health.get("secured", ("",))[0] == "up", f"Prometheus with basic auth over HTTPS: up ({health.get('secured')})")
        nc = health.get("no-credentials", ("", ""))
        check(nc[0] == "down" and "401" in nc[1], f"Prometheus without credentials: down with 401 ({nc})")
        q = urllib.parse.urlencode({"query": 'fulcrum_build_info{job="secured"}'})
        for _ in range(20):
            status, body, _ = get(f"{api}/query?{q}")
            result = json.loads(body)["data"]["result"] if status == 200 else []
            if result:
                break
            time.sleep(0.5)
        check(bool(result), "Prometheus stored fulcrum_build_info from the secured endpoint")
    finally:
        for p in (prom, coord):
            if p is not None:
                p.terminate()
                p.wait(timeout=10)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed; logs in {work}")
        return 1
    subprocess.run(["rm", "-rf", work])
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
