"""A chat template's sandbox: a Jinja2 program from a file, compiled and rendered under limits.

A template is rendered here as transformers and llama.cpp render it:

- a sandboxed environment (``ImmutableSandboxedEnvironment``: a template is data from a file,
  it must not reach Python objects), ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension (``{% break %}``) and transformers' ``{% generation %}`` block;
- the variables ``messages`` (dicts with ``role`` and ``content``), ``add_generation_prompt``,
  ``bos_token`` and ``eos_token`` (the text of the file's BOS and EOS tokens);
- the functions ``raise_exception(message)`` (a template refusing a conversation, e.g. roles
  that do not alternate) and ``strftime_now(format)`` (today's date, which Llama 3.1 prints),
  and transformers' ``tojson`` filter (``ensure_ascii=False``, optional ``indent``).

A template is a program from a file, so it renders under limits (:class:`Limits`): a budget of
steps (each loop iteration, call and filter is one), a wall-clock deadline, a depth of nested
calls (recursive macros), and sizes: no string built or printed past ``max_chars``, no list
past ``max_items``, no integer past ``max_int_bits``; ``range``, ``*``, ``**``, ``+``, ``%``,
``~``, ``tojson``'s indent, widths and the ``replace`` / ``join`` / ``indent`` of strings are
checked *before* they allocate. A template has no loader, so ``{% include %}``, ``{% import %}``
and ``{% extends %}`` fail. Whatever goes wrong while rendering (a limit, Jinja's own errors,
Python's OverflowError, RecursionError, MemoryError, TypeError...) comes out as one
:class:`ChatTemplateError` of one line (docs/decisions.md, D5): :func:`compile_template`
compiles a source, :func:`rendering` is where a template renders.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.sandbox

# A template source longer than this is not a chat template (the longest published ones,
# tool-calling templates, are some 20 KB).
MAX_TEMPLATE_CHARS = 1 << 20


class ChatTemplateError(ValueError):
    """A template that does not compile, that refuses to render a conversation, or that
    goes past a limit while rendering it (one line, naming the template)."""


@dataclass(frozen=True)
class Limits:
    """What one rendering may spend. The defaults are far above what published templates
    need (Llama 3.1's tool template takes some 40 steps a message) and far below what hurts a
    server: a template past them fails in about a second, having allocated little."""

    max_steps: int = 2_000_000  # loop iterations + calls + filters
    max_seconds: float = 5.0  # wall clock, a backstop for steps that are slow
    max_depth: int = 64  # nested calls: macros calling macros, recursive loops
    max_chars: int = 16 << 20  # any string built, and the rendered text
    max_items: int = 1 << 20  # any list or range built
    max_int_bits: int = 4096  # any integer computed (and so widths, counts, exponents)
    max_indent: int = 16  # tojson's indent


DEFAULT_LIMITS = Limits()


class _Budget:
    """The running count of one rendering (one thread renders one template at a time)."""

    def __init__(self, limits: Limits, name: str) -> None:
        self.limits = limits
        self.name = name
        self.steps = 0
        self.depth = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def fail(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(f"chat template {self.name!r} stopped: {what}")

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise self.fail(
                f"it ran more than {self.limits.max_steps} steps (loop iterations and calls)"
            )
        if not self.steps & 1023 and time.monotonic() > self.deadline:
            raise self.fail(f"it rendered for more than {self.limits.max_seconds:g} s")

    def chars(self, n: int, what: str) -> None:
        if n > self.limits.max_chars:
            raise self.fail(f"{what} of {n} characters, more than {self.limits.max_chars}")

    def items(self, n: int, what: str) -> None:
        if n > self.limits.max_items:
            raise self.fail(f"{what} of {n} items, more than {self.limits.max_items}")

    def integer(self, bits: int, what: str) -> None:
        if bits > self.limits.max_int_bits:
            raise self.fail(f"{what} of about {bits} bits, more than {self.limits.max_int_bits}")


_current = threading.local()


def _budget() -> _Budget:
    budget: _Budget | None = getattr(_current, "budget", None)
    if budget is None:  # a template object used outside ChatTemplate.render
        raise ChatTemplateError("chat templates render only through ChatTemplate.render")
    return budget


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict) else 0


def _int_bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) and not isinstance(value, bool) else 0


def _check_args(b: _Budget, args: Iterable[Any], what: str) -> None:
    """Integers that size what a call builds (a width, a count) are bounded by ``max_chars``."""
    for value in args:
        if _int_bits(value) and abs(value) > b.limits.max_chars:
            raise b.fail(f"{what} was given {value}, more than {b.limits.max_chars}")


def _check_format(b: _Budget, fmt: Any, what: str) -> None:
    """A format string (``%``, ``str.format``, the ``format`` filter, ``strftime``) may not
    ask for a width near ``max_chars`` (only the format: the values it formats are data)."""
    if isinstance(fmt, str) and _WIDTH.search(fmt):
        raise b.fail(
            f"{what} was given a format with a width of more than {b.limits.max_chars} characters"
        )


# A width in a format (after "%" and its flags, or after ":" in a replacement field, or a
# strftime field's), with 8 digits or more: near or past ``max_chars`` (16 Mi has 8).
_WIDTH = re.compile(r"[%:][-+ #0_^<>=.*]*\d{8,}")


def _lines(text: str) -> int:
    return text.count("\n") + 1


def _check_text_op(
    b: _Budget, name: str, subject: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[Any, ...]:
    """The output size of the string operations that multiply their input, checked before
    they run; returns ``(subject, *args)`` to run them with (a join's iterable made a list, so
    that it can be counted)."""
    args = tuple(args)
    if name == "replace" and isinstance(subject, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        grows = len(subject) * max(1, len(new)) // max(1, len(old)) + len(new)
        b.chars(grows, "a replace")
    elif name == "join":
        if isinstance(subject, str):  # sep.join(seq)
            sep, seq = subject, _listed(b, args[0] if args else ())
            args = (seq, *args[1:])
        else:  # seq|join(sep)
            sep = kwargs.get("d", args[0] if args else "")
            seq = subject = _listed(b, subject)
        b.chars(len(seq) * _size(sep) + sum(_size(x) for x in seq), "a join")
    elif name == "indent" and isinstance(subject, str):
        width = kwargs.get("width", args[0] if args else 4)
        b.chars(
            len(subject) + _lines(subject) * (_size(width) or abs(int(width or 0))), "an indent"
        )
    return (subject, *args)


def _listed(b: _Budget, seq: Any) -> Any:
    """``seq`` as a sequence whose length is known (an iterator collected, counted)."""
    if isinstance(seq, list | tuple | str | dict | range):
        return seq
    items: list[Any] = []
    for item in seq:
        items.append(item)
        b.items(len(items), "a join")
    return items


def _counted(items: Any) -> Iterator[Any]:
    """A ``for`` loop's iterable, one step per iteration."""
    b = _budget()
    for item in items:
        b.step()
        yield item


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    b = _budget()
    if indent is not None and not 0 <= int(indent) <= b.limits.max_indent:
        raise b.fail(f"tojson's indent {indent} is outside 0..{b.limits.max_indent}")
    if separators is not None and sum(_size(s) for s in separators) > 2 * b.limits.max_indent:
        raise b.fail(f"tojson's separators are longer than {2 * b.limits.max_indent} characters")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _binop(b: _Budget, op: str, left: Any, right: Any) -> None:
    """Check what ``left op right`` would build before it is built."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(n, int):
                (b.chars if isinstance(seq, str) else b.items)(len(seq) * max(0, n), "a repetition")
        b.integer(_int_bits(left) + _int_bits(right), "a product")
    elif op == "**":
        if _int_bits(left) and _int_bits(right) and right > 0 and abs(left) > 1:
            b.integer(_int_bits(left) * right, "a power")
    elif op == "+":
        if isinstance(left, str) and isinstance(right, str):
            b.chars(len(left) + len(right), "a string")
        elif isinstance(left, list | tuple) and isinstance(right, list | tuple):
            b.items(len(left) + len(right), "a list")
    elif op == "%" and isinstance(left, str):
        _check_format(b, left, "'%' formatting")
        if "*" in left:  # widths taken from the values
            _check_args(b, right if isinstance(right, tuple) else (right,), "'%' formatting")


class _BudgetedCodeGenerator(jinja2.compiler.CodeGenerator):
    """``a ~ b`` (a Concat node) through the budget, like ``+``."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        self.write("environment.budgeted_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BudgetedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with every loop iteration, call, filter and sizing operator counted and
    checked against the rendering's :class:`_Budget`."""

    code_generator_class = _BudgetedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Call(
                jinja2.nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None
            )
        return tree

    counted = staticmethod(_counted)

    def budgeted_join(self, parts: Sequence[Any]) -> str:
        b = _budget()
        b.step()
        texts = [str(p) for p in parts]
        b.chars(sum(map(len, texts)), "a string")
        return "".join(texts)

    def call_binop(
        self, context: jinja2.runtime.Context, operator_: str, left: Any, right: Any
    ) -> Any:
        b = _budget()
        b.step()
        _binop(b, operator_, left, right)
        return super().call_binop(context, operator_, left, right)

    def call(
        __self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any
    ) -> Any:
        b = _budget()
        b.step()
        name = getattr(__obj, "__name__", "")
        subject = getattr(__obj, "__self__", None)
        wrapped = getattr(__obj, "__wrapped__", None)  # the sandbox's str.format wrapper
        if subject is None and wrapped is not None:
            subject = getattr(wrapped, "__self__", None)
        _check_args(b, [*args, *kwargs.values()], f"{name or 'a call'}()")
        if isinstance(subject, str):
            if name in ("format", "format_map"):
                _check_format(b, subject, name)
            args = _check_text_op(b, name, subject, args, kwargs)[1:]
        if __obj is _strftime_now and args:
            _check_format(b, args[0], "strftime_now")
        b.depth += 1
        try:
            if b.depth > b.limits.max_depth:
                raise b.fail(f"calls nested more than {b.limits.max_depth} deep")
            return _checked(
                b, super().call(__context, __obj, *args, **kwargs), f"{name or 'a call'}()'s result"
            )
        finally:
            b.depth -= 1


def _checked(b: _Budget, out: Any, what: str) -> Any:
    """A call's result, within the sizes (a string's characters, a list's items)."""
    if isinstance(out, str):
        b.chars(len(out), what)
    elif isinstance(out, list | tuple):
        b.items(len(out), what)
    return out


def _budgeted_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that counts one step, and checks its arguments before it runs and the size
    of its result after. (``functools.wraps`` keeps Jinja's pass-context marker.)"""

    @functools.wraps(f)
    def budgeted(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.step()
        passed = [
            a
            for a in args
            if isinstance(a, jinja2.runtime.Context | jinja2.Environment | jinja2.nodes.EvalContext)
        ]
        values = args[len(passed) :]
        _check_args(b, [*values, *kwargs.values()], f"the {name} filter")
        if name == "format" and values:
            _check_format(b, values[0], "the format filter")
        if values:
            values = _check_text_op(b, name, values[0], values[1:], kwargs)
        return _checked(b, f(*passed, *values, **kwargs), f"the {name} filter's result")

    return budgeted


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens
    with it (for training masks); rendering a prompt, it is just its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        body: list[jinja2.nodes.Node] = parser.parse_statements(
            ("name:endgeneration",), drop_needle=True
        )
        return body


def _environment() -> _BudgetedEnvironment:
    env = _BudgetedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
        keep_trailing_newline=False,
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)  # lorem ipsum of any length: no template needs it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def compile_template(source: str, name: str) -> jinja2.Template:
    """``source`` compiled in the sandbox; ChatTemplateError (naming the template ``name``)
    for one too long or that does not compile."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(
            f"chat template {name!r} is {len(source)} characters, more than {MAX_TEMPLATE_CHARS}"
        )
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(
            f"chat template {name!r} does not compile: {_one_line(exc)}"
        ) from None
    except Exception as exc:  # RecursionError, SyntaxError, MemoryError of a bad source
        raise ChatTemplateError(
            f"chat template {name!r} does not compile: {type(exc).__name__}: {_one_line(exc)}"
        ) from None


@contextlib.contextmanager
def rendering(limits: Limits, name: str) -> Iterator[_Budget]:
    """Where a compiled template renders: its budget of ``limits`` counts every step, and
    whatever goes wrong inside comes out as one ChatTemplateError naming the template."""
    budget = _Budget(limits, name)
    outer = getattr(_current, "budget", None)
    _current.budget = budget
    try:
        yield budget
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template {name!r} failed: {_one_line(exc)}") from None
    except RecursionError:
        raise budget.fail("it recursed too deep") from None
    except MemoryError:
        raise budget.fail("it ran out of memory") from None
    except Exception as exc:  # a template is a program from a file: any Python error
        hint = (
            " (templates have no loader: {% include %}, {% import %} and "
            "{% extends %} cannot be used)"
            if "no loader" in str(exc)
            else ""
        )
        raise ChatTemplateError(
            f"chat template {name!r} failed: {type(exc).__name__}: {_one_line(exc)}{hint}"
        ) from None
    finally:
        _current.budget = outer
