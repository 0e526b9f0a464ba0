"""Which options were typed on the command line (they beat the YAML in ``parser_config``).

Found exactly by the :class:`argparse.ArgumentParser` that made the arguments: the one passed,
else the caller's (a variable holding a parser whose options are all keys of the arguments, in the
frame that called ``parser_config`` or, nearest first, in one of its callers). Without a parser,
``--name``, ``--name=value``, a unique prefix of a name and ``--no-name`` are matched to the
arguments' keys; every other typed option (a short option such as ``-b``, an option whose dest
has another name) is named in a warning, since which key it sets cannot be told: the YAML's value
stays for that key.
"""
import argparse
import logging
import re
from types import FrameType
from typing import Any, List, Optional, Sequence, Set, Tuple

logger = logging.getLogger(__name__)

_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")  # a negative number is a value, not an option


def typed_keys(args: argparse.Namespace, argv: Sequence[str], parser: Optional[argparse.ArgumentParser] = None,
               caller: Optional[FrameType] = None) -> Set[str]:
    """The keys of ``args`` set by options typed in ``argv``.

    Args:
        args: the parsed arguments.
        argv: the command line (without the program name).
        parser: the parser that made ``args``; if None, it is looked for from ``caller`` outward.
        caller: the frame of ``parser_config``'s caller.

    Returns:
        The dests of the typed options. Without a parser, options that cannot be matched to a key
        are left out, each named in a warning.
    """
    parser = parser or _callers_parser(args, caller)
    if parser is not None:
        try:
            return _typed_by_parser(parser, argv)
        except SystemExit:  # argv is not this parser's command line (it printed why)
            logger.warning("the ArgumentParser found beside parser_config's caller does not parse the command "
                           "line %s; matching options by --name instead", list(argv))
    typed, unmatched = _typed_by_name(args, argv)
    for flag in unmatched:
        logger.warning("parser_config: cannot tell which key the typed option %r sets without the ArgumentParser "
                       "(short options and options whose dest has another name need it), so the YAML's value "
                       "stays for that key; pass parser=<your ArgumentParser> to parser_config", flag)
    return typed


def _made_by(parser: argparse.ArgumentParser, keys: Set[str]) -> bool:
    """Whether ``parser`` could have made arguments with these keys (all its dests are among them)."""
    dests = {a.dest for a in parser._actions if a.dest != argparse.SUPPRESS and a.default != argparse.SUPPRESS}
    return bool(dests) and dests <= keys


def _callers_parser(args: argparse.Namespace, frame: Optional[FrameType]) -> Optional[argparse.ArgumentParser]:
    """The one parser that made ``args`` among the variables of ``frame`` and its callers, nearest first."""
    # Why frames: argparse gives the exact answer (_typed_by_parser: parse_known_args with every
    # default the SUPPRESS sentinel), but only from the parser, and a Namespace keeps no reference
    # to the parser that made it. The seed's scripts call parser_config(parser.parse_args())
    # without it, and a typed short option (-b 64) must still beat the YAML (test_config). What
    # else finds it is worse: patching ArgumentParser when basetrainer is imported (a side effect
    # on every parser of the process), or searching the heap (gc.get_objects: every parser ever
    # made, none nearer than another).
    keys = set(vars(args))
    try:
        while frame is not None:
            found = {id(v): v for scope in (frame.f_locals, frame.f_globals) for v in list(scope.values())
                     if isinstance(v, argparse.ArgumentParser) and _made_by(v, keys)}
            if found:
                return next(iter(found.values())) if len(found) == 1 else None  # two candidates: no guess
            frame = frame.f_back
    finally:
        del frame
    return None


def _typed_by_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Set[str]:
    """Parse ``argv`` again with every default suppressed: what is left was typed."""
    saved: List[Tuple[Any, Any, bool]] = [(a, a.default, a.required) for a in parser._actions]
    try:
        for action in parser._actions:
            action.default, action.required = argparse.SUPPRESS, False
        seen, _ = parser.parse_known_args(list(argv))
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required
    return set(vars(seen))


def _typed_by_name(args: argparse.Namespace, argv: Sequence[str]) -> Tuple[Set[str], List[str]]:
    """``--name`` options matched to the keys of ``args``, and the options that match none."""
    typed: Set[str] = set()
    unmatched: List[str] = []
    known = set(vars(args))
    config_file = getattr(args, "config_file", None)
    tokens = list(argv)
    for i, token in enumerate(tokens):
        if token == "--":  # the rest is positional
            break
        if not token.startswith("-") or token == "-" or _NUMBER.match(token):
            continue
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            candidates = [name] + ([name[3:]] if name.startswith("no_") else [])
            # argparse accepts unique prefixes (--batch for --batch_size)
            matches = [next((c for c in candidates if c in known), None)]
            if matches[0] is None:
                matches = [k for c in candidates for k in known if k.startswith(c)]
            if len(set(matches)) == 1:
                typed.add(matches[0])
                continue
        if config_file and i + 1 < len(tokens) and tokens[i + 1] == config_file:
            continue  # -c <the config file>: it sets config_file, which the YAML does not
        unmatched.append(token)
    return typed, unmatched
