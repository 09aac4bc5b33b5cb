"""`deltaserve chat`: talk to the served model from the terminal, through GenerateRequest.messages
(the server renders the model's chat template).

    deltaserve chat "question"    one answer, streamed to stdout, then exit
    deltaserve chat               interactive: the history is kept and sent with every question;
                                  /reset clears it, /exit or Ctrl-D leaves; Ctrl-C while an answer
                                  streams cancels that answer (its question is dropped from the
                                  history) and the chat goes on

Torch-free: only grpc and the generated stubs.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, TextIO

import grpc

from deltaserve.client import (add_connection_flags, add_sampling_flags, open_channel,
                               set_options)
from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import generation_pb2_grpc

DEFAULT_MAX_TOKENS = 512
HELP = ("/reset clears the history, /exit or Ctrl-D leaves; Ctrl-C stops an answer while it "
        "streams.")


def build_parser(p: argparse.ArgumentParser, default_target: str) -> argparse.ArgumentParser:
    p.add_argument("question", nargs="?", default=None,
                   help="ask one question, print the answer and exit (default: interactive)")
    p.add_argument("--target", default=default_target,
                   help=f"HOST:PORT of the scheduler (default: {default_target})")
    p.add_argument("--system", default=None, help="a system message opening the chat")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"longest answer in tokens (default: {DEFAULT_MAX_TOKENS})")
    add_sampling_flags(p)
    p.add_argument("--timeout", type=float, default=None,
                   help="deadline of one answer in seconds (default: none)")
    add_connection_flags(p)
    return p


@dataclass
class Answer:
    text: str = ""
    cancelled: bool = False
    error: str | None = None
    finish_reason: int = 0


@dataclass
class Conversation:
    """The messages sent with the next question."""

    system: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)   # (role, content)

    def messages(self, question: str) -> list[pb.ChatMessage]:
        head = [("system", self.system)] if self.system else []
        return [pb.ChatMessage(role=r, content=c)
                for r, c in head + self.turns + [("user", question)]]


def chat_request(conversation: Conversation, question: str, args) -> pb.GenerateRequest:
    req = pb.GenerateRequest(messages=conversation.messages(question))
    set_options(req, args)
    return req


def stream_answer(stub, req: pb.GenerateRequest, out: TextIO,
                  timeout: float | None = None) -> Answer:
    """Print the answer as it streams. Ctrl-C cancels the call: a cancelled Answer.

    In the main thread Ctrl-C cancels the call from a SIGINT handler, so the stream ends with
    CANCELLED: a KeyboardInterrupt raised inside grpc's iterator can land between its
    condition's release and re-acquire and crash the chat instead of cancelling."""
    answer = Answer()
    call = stub.Generate(req, timeout=timeout)

    def cancel(_signum, _frame) -> None:
        if call.cancel():                  # False once the answer has finished
            answer.cancelled = True

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, cancel) if in_main else None
    try:
        for resp in call:
            out.write(resp.text)
            out.flush()
            answer.text += resp.text
            answer.finish_reason = resp.finish_reason
    except KeyboardInterrupt:              # off the main thread, or before the handler
        call.cancel()
        answer.cancelled = True
    except grpc.RpcError as e:
        if not answer.cancelled:
            answer.error = f"{e.code().name}: {e.details()}"
    finally:
        if in_main and previous is not None:   # None: a handler not set from Python
            signal.signal(signal.SIGINT, previous)
    return answer


def run_chat(args) -> int:
    """`deltaserve chat`: one-shot with a question, else interactive."""
    set_options(pb.GenerateRequest(), args)     # a flag out of its field's range: say so now
    with open_channel(args) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        if args.question is not None:
            return _one_shot(stub, args)
        return Session(stub, args, input, sys.stdout).run()


def _one_shot(stub, args) -> int:
    answer = stream_answer(stub, chat_request(Conversation(args.system), args.question, args),
                           sys.stdout, args.timeout)
    print(flush=True)
    if answer.error:
        print(f"error: {answer.error}", file=sys.stderr)
        return 1
    return 130 if answer.cancelled else 0


class Session:
    """The interactive loop; `read(prompt)` is input() (EOFError on Ctrl-D)."""

    def __init__(self, stub, args, read: Callable[[str], str], out: TextIO):
        self.stub, self.args, self.read, self.out = stub, args, read, out
        self.conversation = Conversation(args.system)

    def run(self) -> int:
        name = self._model_name()
        if name is None:
            return 1
        self.out.write(f"Chatting with {name} at {self.args.target}. {HELP}\n")
        while True:
            try:
                line = self.read("> ").strip()
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n(/exit or Ctrl-D leaves the chat)\n")
                continue
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                self.conversation.turns.clear()
                self.out.write("(history cleared)\n")
            elif line:
                self.ask(line)

    def ask(self, question: str) -> Answer:
        """Stream one answer; keep the turn in the history unless it was cancelled or failed."""
        req = chat_request(self.conversation, question, self.args)
        answer = stream_answer(self.stub, req, self.out, self.args.timeout)
        if answer.cancelled:
            self.out.write("\n(answer cancelled; the question is not kept)\n")
        elif answer.error:
            # The history only grows: once it no longer fits, every later question failed the
            # same way, and nothing said how to go on.
            hint = ("\n(the conversation no longer fits the model: /reset clears the history)"
                    if self.conversation.turns and "max_model_len" in answer.error else "")
            self.out.write(f"\nerror: {answer.error}{hint}\n")
        else:
            self.out.write("\n")
            self.conversation.turns += [("user", question), ("assistant", answer.text)]
        self.out.flush()
        return answer

    def _model_name(self) -> str | None:
        """The served model's name; None (after saying why) when chatting cannot work."""
        try:
            info = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        except grpc.RpcError as e:
            print(f"error: {self.args.target}: {e.code().name}: {e.details()}", file=sys.stderr)
            return None
        if not info.has_chat_template:
            print(f"error: {info.model_name} has no chat template: use `deltaserve generate` "
                  "with raw text", file=sys.stderr)
            return None
        return info.model_name
