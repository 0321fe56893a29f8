"""`sharp-client generate|info|health`: the gRPC API from a shell.

It never loads torch or the model code; mistakes exit 2 with one line, a failed call exits 1 with the status and its
details, Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from sharp.models.messages import Parser, UsageError
from sharp.serving.credentials import auth_token, tls_roots


def _connection_flags(ap: argparse.ArgumentParser, defaults: bool) -> None:
    """The flags of the connection, before the command or after it (`sharp-client generate --target H:P`); only the
    top level sets defaults, so a flag given after the command is never overwritten by one."""
    default = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    ap.add_argument("--target", default=default("127.0.0.1:50051"), help="host:port of the server")
    ap.add_argument("--timeout", type=float, default=default(None), help="deadline of each call in seconds")
    ap.add_argument("--auth-token-file", type=Path, default=default(None))
    ap.add_argument("--tls-ca", type=Path, default=default(None), help="PEM root certificate: connect with TLS")


def client_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="sharp-client", description="Talk to a sharp-serve server.")
    _connection_flags(ap, defaults=True)
    connection = argparse.ArgumentParser(add_help=False)
    _connection_flags(connection, defaults=False)
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser)
    gen = sub.add_parser("generate", help="generate from a prompt", parents=[connection])
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print text as it is produced")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stats", action="store_true", help="print the request's per-head attention entropy")
    sub.add_parser("info", help="the served model", parents=[connection])
    sub.add_parser("health", help="the server's health status", parents=[connection])
    return ap


def format_stats(stats) -> str:
    """A layer × head table of mean entropy (normalized entropy)."""
    heads = max((h.head for h in stats.heads), default=-1) + 1
    lines = [
        f"attention ({stats.norm}), mean over {stats.positions} positions: entropy nats (normalized entropy)",
        f"{'layer':<7}" + "".join(f"{'head ' + str(h):>16}" for h in range(heads)),
    ]
    for layer in sorted({h.layer for h in stats.heads}):
        cells = [h for h in stats.heads if h.layer == layer]
        lines.append(
            f"{layer:<7}" + "".join(f"{h.mean_entropy:>9.3f} ({h.mean_normalized_entropy:.2f})" for h in cells)
        )
    return "\n".join(lines)


def client_main(argv: list[str] | None = None) -> int:
    # gRPC's C core logs to fd 2 from its own threads (a Ctrl-C can make its poller report a closed descriptor);
    # the client says what went wrong in its own one line, so the core stays quiet unless the user asks for it
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import grpc
    from google.protobuf import json_format

    from sharp.serving.api.client import Client

    args = client_parser().parse_args(argv)
    try:
        token = auth_token(args.auth_token_file)
        root = tls_roots(args.tls_ca)
    except UsageError as e:
        print(f"sharp-client: {e}", file=sys.stderr)
        return 2
    client = Client(args.target, token, root, args.timeout)
    try:
        if args.command == "health":
            status = client.health()
            print(status)
            if status != "SERVING":  # as grpc_health_probe: a probe or script can rely on the exit status
                return 1
        elif args.command == "info":
            print(json.dumps(json_format.MessageToDict(client.info()), indent=2))
        else:
            kw = dict(
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
                stop=args.stop,
                attention_stats=args.stats,
            )
            if args.stream:
                last = None
                for chunk in client.generate_stream(args.prompt, **kw):
                    print(chunk.text, end="", flush=True)
                    last = chunk
                print()
            else:
                last = client.generate(args.prompt, **kw)
                print(last.text)
            from sharp.v1 import generator_pb2 as pb

            reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
            print(
                f"[finish: {reason}; prompt {last.usage.prompt_tokens} tokens, "
                f"completion {last.usage.completion_tokens} tokens]",
                file=sys.stderr,
            )
            if args.stats and last.HasField("attention_stats"):
                print(format_stats(last.attention_stats))
    except grpc.RpcError as e:
        print(f"sharp-client: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the call is cancelled as the channel closes; one line, the shell's status
        print("\nsharp-client: interrupted", file=sys.stderr)
        return 130
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(client_main())
