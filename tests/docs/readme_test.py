"""The commands README.md and docs/*.md show, checked as written.

Every command line of their code blocks that runs one of the project's
binaries or scripts (build/..., deploy/...) names a file that exists, and
each --flag it gives is one that program knows (its --helpfull, or the
script's own usage). The README's "Running a parameter server alone" block
runs as written (on free ports instead of 7000 and 7001, and metrics on
free ports): both servers start and serve.

    readme_test.py SOURCE_DIR BUILD_DIR
"""
import glob
import os
import re
import shlex
import socket
import subprocess
import sys
import time

SRC, BUILD = sys.argv[1], sys.argv[2]
FAILURES = []


def commands(path):
    """(line number, command) of each code-block line that runs build/ or
    deploy/ programs, continuation lines joined, comments dropped."""
    out, pending, start = [], "", 0
    for n, raw in enumerate(open(path, encoding="utf-8"), 1):
        if not raw.startswith("    ") and not pending:
            continue
        line = raw.strip()
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        line = re.sub(r"\s+#.*$", "", line)
        if re.match(r"^(build|deploy)/\S+", line):
            out.append((start, line))
    return out


HELP = {}


def known_flags(program):
    """A binary's flags by its --helpfull; a script's by the options its
    argument loop takes (`--name)` or `--name|` in a case pattern)."""
    if program not in HELP:
        if program.endswith(".sh"):
            text = open(program, encoding="utf-8").read()
            HELP[program] = set(re.findall(r"^\s*(?:-\w\|)?--([a-z][a-z0-9_-]*)[)|]", text, re.M))
        else:
            r = subprocess.run([program, "--helpfull"], capture_output=True, text=True, timeout=60)
            HELP[program] = set(re.findall(r"--([a-z][a-z0-9_-]*)", r.stdout + r.stderr))
    return HELP[program]


def check(path):
    for n, line in commands(path):
        where = f"{os.path.relpath(path, SRC)}:{n}: {line[:100]}"
        try:
            words = shlex.split(line.split("|")[0])
        except ValueError:
            words = line.split()
        head = words[0]
        program = os.path.join(BUILD, head[len("build/"):]) if head.startswith("build/") else os.path.join(SRC, head)
        if head.endswith("/") or "..." in head:
            continue  # a folder named in prose
        if not os.path.exists(program):
            FAILURES.append(f"{where}: {head} does not exist")
            continue
        flags = [re.match(r"--([a-z][a-z0-9_-]*)", w).group(1) for w in words[1:] if re.match(r"--[a-z]", w)]
        unknown = [f for f in flags if f not in known_flags(program)]
        if unknown:
            FAILURES.append(f"{where}: {head} knows no --{', --'.join(unknown)}")


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_servers_alone():
    """The README's block, with free ports for 7000 and 7001."""
    text = open(os.path.join(SRC, "README.md"), encoding="utf-8").read()
    block = text.split("## Running a parameter server alone", 1)[1].split("\n\n", 2)[1]
    lines = [cmd for _, cmd in commands_of_text(block)]
    if len(lines) != 2:
        FAILURES.append(f"README.md: 'Running a parameter server alone' has {len(lines)} commands, not 2")
        return
    a, b = free_ports(2)
    procs = []
    try:
        for cmd in lines:
            cmd = cmd.replace("127.0.0.1:7000", f"127.0.0.1:{a}").replace("127.0.0.1:7001", f"127.0.0.1:{b}")
            # Metrics on any free port too (9401 and on may be taken here).
            words = shlex.split(cmd) + ["--metrics_addr=127.0.0.1:0"]
            words[0] = os.path.join(BUILD, words[0][len("build/"):])
            procs.append(subprocess.Popen(words, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.time() + 20
        for port in (a, b):
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.time() > deadline or any(p.poll() is not None for p in procs):
                        break
                    time.sleep(0.1)
        for p in procs:
            if p.poll() is not None:
                FAILURES.append(f"README.md: a server of 'Running a parameter server alone' exited: {p.stdout.read()}")
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def commands_of_text(text):
    path = os.path.join(BUILD, "readme-block.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return commands(path)


docs = [os.path.join(SRC, "README.md")] + sorted(glob.glob(os.path.join(SRC, "docs", "*.md")))
for d in docs:
    check(d)
run_servers_alone()
checked = sum(len(commands(d)) for d in docs)
for f in FAILURES:
    print("FAIL:", f)
print(f"{checked} commands in README.md and docs/: {len(FAILURES)} failed")
sys.exit(1 if FAILURES else 0)
