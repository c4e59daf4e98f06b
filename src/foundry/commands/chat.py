"""`foundry chat`: talk to a GGUF model in this one process, with its chat template."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from foundry.commands.common import (
    add_threads_flag,
    fraction,
    nonneg_float,
    nonneg_int,
    positive_int,
    use_threads,
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser(
        "chat",
        help="chat with a GGUF model in this one process (interactive, streamed)",
        description="Read a message per line from stdin, answer each as the assistant, streamed "
        "as it comes; the whole conversation goes through the model's chat template every turn. "
        "End with Ctrl+D (or an empty line).",
    )
    c.add_argument("--model", type=Path, required=True, help="GGUF model file")
    c.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|FILE",
        help="a built-in (gemma, chatml, llama3, plain) or a Jinja file (default: "
        "the file's tokenizer.chat_template, else plain: a file without one is "
        "taken for a base model)",
    )
    c.add_argument(
        "--chat-content-specials",
        action="store_true",
        help="parse special-token texts in what you type as the special tokens "
        "(llama.cpp's way); by default they stay text",
    )
    c.add_argument("--system", default=None, metavar="TEXT", help="a system message first")
    c.add_argument(
        "--max-tokens",
        type=positive_int,
        default=256,
        help="tokens per reply at most (default 256)",
    )
    c.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy (default 0)")
    c.add_argument("--top-p", type=fraction, default=1.0, help="nucleus sampling mass (default 1)")
    c.add_argument(
        "--top-k",
        type=nonneg_int,
        default=0,
        help="sample among the K most probable tokens (default 0: all)",
    )
    c.add_argument("--seed", type=nonneg_int, default=0, help="sampling seed (default 0)")
    add_threads_flag(c, training=False)
    c.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    from foundry.model.formats.gguf_io import load_gguf_stored
    from foundry.model.formats.gguf_model import GGUFError
    from foundry.model.infer.generate import printable
    from foundry.model.infer.inference import Engine
    from foundry.model.infer.sampling import SamplingError, make_rng, sample
    from foundry.model.text.chat import Message, chat_prompt, template_for
    from foundry.model.text.chat_sandbox import ChatTemplateError
    from foundry.model.text.vocab import TokenizerError, load_tokenizer
    from foundry.tp.policy import TextStream

    try:
        loaded = load_gguf_stored(args.model)
        tokenizer = load_tokenizer(loaded.metadata)
        template = template_for(loaded.metadata, args.chat_template)
    except (GGUFError, OSError, ChatTemplateError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = Engine(loaded.cfg, loaded.params, threads=use_threads(args))
    rng = make_rng(args.seed)
    stop = template.stop
    print(f"chat template: {template.name}", file=sys.stderr)
    history = [Message("system", args.system)] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        history.append(Message("user", line.rstrip("\n")))
        try:
            # The template's turn markers are the model's special tokens; what was typed is
            # text (unless --chat-content-specials).
            tokens = chat_prompt(
                template, tokenizer, history, content_specials=args.chat_content_specials
            )
            session = engine.new_session()
            if len(tokens) >= session.ctx_size:
                print(
                    f"error: the conversation is {len(tokens)} tokens, the context "
                    f"{session.ctx_size}; start a new one",
                    file=sys.stderr,
                )
                return 1
            logits = engine.decode(session, tokens, last_only=True)[-1]
            text = TextStream(stop, tokenizer.stream_decoder())
            reply: list[str] = []
            for n in range(1, args.max_tokens + 1):
                token = sample(
                    logits,
                    args.temperature,
                    args.top_p,
                    rng if args.temperature > 0 else None,
                    args.top_k,
                )
                last = token in tokenizer.eog_ids or n == args.max_tokens or session.free == 0
                piece, hit = text.push(token, final=last)
                reply.append(piece)
                sys.stdout.write(printable(piece))
                sys.stdout.flush()
                if last or hit:
                    break
                logits = engine.decode(session, [token])[-1]
        except (ChatTemplateError, SamplingError, ValueError) as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write("\n")
        history.append(Message("assistant", "".join(reply)))
