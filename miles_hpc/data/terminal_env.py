"""The reference multi-turn environment: a terminal-style task over a small simulated filesystem (stage: data: the
tasks and their simulation, pure Python; `rollout/agents.py` has the agent that plays them).

Nothing here touches the host: the "shell" is a Python interpreter of a handful of commands over an in-memory tree
of text files. A task is generated reproducibly from a seed (`make_terminal_task(seed)`): some files with lines of
words and log records, and a goal whose answer must end up in `/answer.txt`; the reward is 1 when the final state
holds the right answer, else 0 (`TerminalEnv.reward`).

Commands (one per turn, the first non-empty line of the model's message, a leading `$ ` ignored):
  ls [dir] | cat FILE | head [-n N] FILE | grep WORD FILE | wc -l FILE | find [dir] -name SUBSTR | pwd | cd DIR |
  echo TEXT > FILE | submit
Anything else, a missing file or a malformed command gets an `error: ...` line back, never an exception; output is
cut at `max_output_chars` (with a note saying so). `submit` (or the turn limit) ends the episode.
"""

from __future__ import annotations

import posixpath
import random
import shlex
from dataclasses import dataclass, field

__all__ = ["TerminalEnv", "TerminalTask", "make_terminal_task", "parse_command"]

_WORDS = ("alpha", "bravo", "delta", "echo", "golf", "kilo", "lima", "oscar", "tango", "zulu")
_LEVELS = ("INFO", "WARN", "ERROR")


@dataclass(frozen=True)
class TerminalTask:
    files: dict[str, str]  # absolute path -> content
    goal: str
    answer: str  # what /answer.txt must hold (stripped)
    kind: str


def make_terminal_task(seed: int) -> TerminalTask:
    """A task drawn from `seed` alone: same files, goal and answer on every platform."""
    rng = random.Random(f"miles-terminal/{seed}")
    files: dict[str, str] = {}
    for i in range(rng.randint(3, 5)):
        files[f"/data/file{i}.txt"] = "\n".join(" ".join(rng.sample(_WORDS, 3)) for _ in range(rng.randint(2, 4)))
    log = [f"{rng.choice(_LEVELS)} request {rng.randint(100, 999)}" for _ in range(rng.randint(4, 9))]
    files["/logs/app.log"] = "\n".join(log)
    files["/notes/todo.txt"] = "\n".join(f"{rng.choice(_WORDS)} {rng.randint(1, 9)}" for _ in range(3))
    kind = rng.choice(["find", "count", "first_line"])
    if kind == "find":
        target = rng.choice(sorted(p for p in files if p.startswith("/data/")))
        word = f"marker{rng.randint(10, 99)}"
        files[target] += f"\n{word}"
        goal, answer = f"Which file under /data contains the word {word}? Write its path to /answer.txt.", target
    elif kind == "count":
        goal = "How many lines of /logs/app.log contain ERROR? Write the number to /answer.txt."
        answer = str(sum("ERROR" in line for line in log))
    else:
        goal = "Write the first line of /notes/todo.txt to /answer.txt."
        answer = files["/notes/todo.txt"].split("\n")[0]
    return TerminalTask(files=files, goal=goal, answer=answer, kind=kind)


def parse_command(message: str) -> str:
    """The command in a model message: its first non-empty line, without a leading `$ ` prompt."""
    for line in message.splitlines():
        line = line.strip()
        if line:
            return line[2:].strip() if line.startswith("$ ") else line
    return ""


@dataclass
class TerminalEnv:
    task: TerminalTask
    max_output_chars: int = 400
    cwd: str = "/"
    files: dict[str, str] = field(default_factory=dict)
    done: bool = False
    steps: int = 0

    def __post_init__(self) -> None:
        self.files = dict(self.task.files)

    def reward(self) -> float:
        return 1.0 if self.files.get("/answer.txt", "").strip() == self.task.answer else 0.0

    def step(self, message: str) -> str:
        """Run the command in `message`; returns what the terminal prints (never raises)."""
        self.steps += 1
        command = parse_command(message)
        try:
            out = self._run(command)
        except (ValueError, IndexError) as e:  # shlex quoting errors, missing arguments
            out = f"error: {e}"
        if len(out) > self.max_output_chars:
            out = out[: self.max_output_chars] + f"\n[output cut at {self.max_output_chars} characters]"
        return out

    def _path(self, p: str) -> str:
        return posixpath.normpath(posixpath.join(self.cwd, p))

    def _dirs(self) -> set[str]:
        out = {"/"}
        for f in self.files:
            d = posixpath.dirname(f)
            while d not in out:
                out.add(d)
                d = posixpath.dirname(d)
        return out

    def _read(self, p: str) -> str:
        path = self._path(p)
        if path not in self.files:
            raise ValueError(f"{p}: no such file")
        return self.files[path]

    def _run(self, command: str) -> str:
        if not command:
            return "error: empty command"
        if command == "submit":
            self.done = True
            return "submitted"
        if command.startswith("echo ") and ">" in command:
            text, target = command[5:].rsplit(">", 1)
            self.files[self._path(target.strip())] = text.strip().strip("'\"")
            return ""
        argv = shlex.split(command)
        cmd, args = argv[0], argv[1:]
        if cmd == "pwd":
            return self.cwd
        if cmd == "cd":
            path = self._path(args[0] if args else "/")
            if path not in self._dirs():
                raise ValueError(f"cd: {path}: no such directory")
            self.cwd = path
            return ""
        if cmd == "ls":
            d = self._path(args[0] if args else ".")
            if d not in self._dirs():
                raise ValueError(f"ls: {d}: no such directory")
            names = {
                p[len(d.rstrip("/")) + 1 :].split("/")[0]
                for p in [*self.files, *self._dirs()]
                if p.startswith(d.rstrip("/") + "/") and p != d
            }
            return "\n".join(sorted(names))
        if cmd == "cat":
            return self._read(args[0])
        if cmd == "head":
            n = int(args[1]) if args[0] == "-n" else 10
            return "\n".join(self._read(args[-1]).split("\n")[:n])
        if cmd == "grep":
            return "\n".join(line for line in self._read(args[1]).split("\n") if args[0] in line)
        if cmd == "wc" and args[:1] == ["-l"]:
            return f"{len(self._read(args[1]).split(chr(10)))} {args[1]}"
        if cmd == "find":
            root = self._path(args[0]) if args and args[0] != "-name" else self.cwd
            name = args[args.index("-name") + 1] if "-name" in args else ""
            return "\n".join(sorted(p for p in self.files if p.startswith(root.rstrip("/") + "/") and name in p))
        return (
            f"error: unknown command {cmd!r} (try ls, cat, head, grep, wc -l, find, pwd, cd, echo TEXT > FILE, submit)"
        )
