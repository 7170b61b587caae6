"""What the command refuses in one line: a config the parser refused and a value a constructor of this package
refused (each with its config key, exit 2), and a missing optional package (exit 1).

A single value where a group of options goes (``guard_rail: 0.05``, ``trainer: 5``, ``init_args: [1]``) is
told by what jsonargparse was given for which group, never by its messages: ``group_refusal`` says what the
group takes, ``_Parser`` (``loops_callbacks.cli``) raises it where jsonargparse takes the value, and
``unloadable_group`` finds the group whose path or YAML text held no options in the frames of the error.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import pydoc
import re
import sys
import traceback
import typing
from collections.abc import Iterator
from typing import Any

from jsonargparse import Namespace
from jsonargparse._actions import _ActionConfigLoad  # the action of an options group (a dataclass, the trainer)

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


class Constructors:
    """jsonargparse's instantiator for every class but the model and the data (Lightning has its own for those),
    keeping each ``ValueError`` / ``TypeError`` a constructor raises.

    jsonargparse chains only the first alternative's error to the one it raises for a union type
    (``str | Correction``), so what a constructor said of a later alternative is found here.
    """

    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def __call__(self, class_type: type, *args: Any, **kwargs: Any) -> Any:
        try:
            return class_type(*args, **kwargs)
        except (ValueError, TypeError) as error:
            self.errors.append(error)
            raise


def refusal_line(error: BaseException, seen: list[Exception], config: Any) -> str | None:
    """``"<config key> (<class>): <what its constructor said>"`` when ``error`` comes from (its explicit causes,
    then what ``Constructors`` saw) a ``ValueError`` / ``TypeError`` of a constructor of this package, else ``None``."""
    for candidate in [*reversed(list(_causes(error))), *seen]:
        made = _made_by_this_package(candidate) if isinstance(candidate, (ValueError, TypeError)) else None
        if made is not None:
            key, name, message = _config_key_of(config, made) or "the config", type(made).__name__, str(candidate)
            message = " ".join(message.split("\n"))
            return key + ("" if message.startswith(name) else f" ({name})") + f": {message}"
    return None


_KEY, _CLASS = re.compile(r'Parser key "(.+?)":\s*(.*)'), re.compile(r"Problem with given class_path '(.+)':")
_NOT_ACCEPTED = re.compile(r"Option '(.+)' is not accepted")
_NOT_A_FILE = "Expected a path but "
_ONLY_CONTEXT = ("Does not validate against", "Subtypes:", "Errors:", "Given value")


def parse_error_line(message: str, problem: tuple[str, str] | None = None) -> str:
    """jsonargparse's (many-line) parse error as one line: the keys and classes down to the first problem, then
    the problem, and where a key that is not accepted belongs when it is a field of one of the class's groups.
    ``problem``: ``(key, what to say)`` instead of the problem, when it is the innermost key's.

    Examples:
        >>> print(parse_error_line('Parser key "trainer.max_steps":' + chr(10) + "  Expected an int. Got value: abc"))
        trainer.max_steps: Expected an int. Got value: abc
    """
    key_said, said = problem or ("", None)
    innermost = ""  # the innermost key so far
    lines, path, class_path, key_indent, not_a_file = message.splitlines(), "", None, None, False
    passed_over: int | None = None  # the indent of an alternative of a union passed over, while in it
    for index, line in enumerate(lines):
        text, indent = line.strip().removeprefix("- "), len(line) - len(line.lstrip())
        if passed_over is not None and indent > passed_over:
            continue
        passed_over = None
        if line.lstrip().startswith("- ") and not _CLASS.fullmatch(text) and _a_later_class(lines[index + 1 :], indent):
            passed_over = indent  # of a union's alternatives, the one that reached a class says what is wrong
            continue
        if text.startswith(_NOT_A_FILE):  # a string is read as a file of the value first: the type's error follows
            not_a_file = True
            continue
        if key := _KEY.fullmatch(text):
            path, key_indent, text = path + (": " if path else "") + key[1], indent, key[2]
            innermost = key[1]
        if key and not text:
            continue
        if given := _CLASS.fullmatch(text):
            class_path, key_indent = given[1], None
            path += f" ({class_path.rpartition('.')[2]})"
        elif said is not None and innermost == key_said and text and not text.startswith(_ONLY_CONTEXT):
            return f"{path}: {said}" if path else said  # (said of another key, it is not this problem)
        elif text and not text.startswith(_ONLY_CONTEXT):
            option = _NOT_ACCEPTED.fullmatch(text)
            group = _group_holding(class_path, option[1]) if option and class_path else None
            problem = text + (f": it is a field of {group} ({group}: {{{option[1]}: ...}})" if group else "")
            if key_indent is not None:  # the value the innermost key was given, where jsonargparse shows it
                shown = " " * (key_indent + 2) + "Given value: "
                value = next((rest[len(shown):] for rest in lines[index + 1 :] if rest.startswith(shown)), None)
                problem += "" if value is None or text.endswith(f": {value}") else f", got {value}"
            problem += ", nor the path of a file holding one" if not_a_file else ""
            return f"{path}: {problem}" if path else problem
    return " ".join(message.split())


def _a_later_class(lines: list[str], indent: int) -> bool:
    """Whether a later alternative of the same union (a ``- `` line of this indent, before the union's end) is a
    problem with a given class: one that went that far, as a list of loggers whose item is wrong does."""
    for line in lines:
        depth = len(line) - len(line.lstrip())
        if depth < indent:
            return False
        if depth == indent and line.lstrip().startswith("- ") and _CLASS.fullmatch(line.strip()[2:]):
            return True
    return False


_SHOWN_OPTIONS = 6  # the options a refusal names (then "...")


def group_refusal(name: str, options: typing.Sequence[str], value: Any, owner: str = "", *, path: bool = True) -> str:
    """What the group of options ``name`` (of ``owner``'s ``options``) takes, said of ``value``, given for it.

    Examples:
        >>> print(group_refusal("guard_rail", ["max_kl", "patience"], 0.05, "GuardRail"))
        takes a group of options, GuardRail's (max_kl, patience), as in guard_rail: {max_kl: ...} (or the path of a YAML file holding one); got 0.05
        >>> print(group_refusal("init_args", [], None, path=False))
        takes a group of options, as in init_args: {name: value}; got null
    """
    shown = ", ".join([*options[:_SHOWN_OPTIONS], *(["..."] if len(options) > _SHOWN_OPTIONS else [])])
    listed = f", {owner}'s ({shown})" if owner and shown else f" ({shown})" if shown else ""
    example = f"{options[0]}: ..." if options else "name: value"
    file = " (or the path of a YAML file holding one)" if path else ""
    return f"takes a group of options{listed}, as in {name}: {{{example}}}{file}; got {_shown(value)}"


def group_value_refusal(action: Any, value: Any) -> str | None:
    """``"<group>: <group_refusal>"`` when ``action`` takes an options group (jsonargparse's ``_ActionConfigLoad``)
    and ``value`` is one that never is one (a number, a bool, a list, ``null``); else ``None``. A string is the path
    or the YAML text of a group, for jsonargparse to read (``unloadable_group`` finds one that holds no group)."""
    if not isinstance(action, _ActionConfigLoad) or not (value is None or isinstance(value, (int, float, list, tuple))):
        return None
    options, owner = _options_of(getattr(action, "basetype", None))
    return f"{action.dest}: {group_refusal(action.dest, options, value, owner)}"


def init_args_refusal(options: typing.Sequence[str], value: Any) -> str:
    """``"init_args: <group_refusal>"``: a class's ``init_args`` given something else than a mapping of its options."""
    return f"init_args: {group_refusal('init_args', options, value, path=False)}"


def unloadable_group(error: BaseException | None) -> tuple[str, str] | None:
    """``(the group's key, group_refusal)`` for the options group whose given path or YAML text ``error`` came from
    reading, when what it read holds no options (``--trainer.callbacks.init_args.guard_rail 0.05``); else ``None``.

    Found in the frames of the error's tracebacks (jsonargparse's ``_ActionConfigLoad._load_config``, its
    ``value`` and what it read, ``cfg``), not in its message.
    """
    for candidate in _causes_and_contexts(error):
        for frame, _ in traceback.walk_tb(candidate.__traceback__):
            action, read = frame.f_locals.get("self"), frame.f_locals.get("cfg")
            if (frame.f_code.co_name == "_load_config" and isinstance(action, _ActionConfigLoad)
                    and not isinstance(read, (dict, Namespace))):
                options, owner = _options_of(getattr(action, "basetype", None))
                return action.dest, group_refusal(action.dest, options, frame.f_locals.get("value"), owner)
    return None


def _options_of(kind: Any) -> tuple[list[str], str]:
    """The options a class (a dataclass, the Trainer) takes by name, and its name; none when it cannot be told."""
    try:
        parameters = inspect.signature(kind).parameters.values() if inspect.isclass(kind) else ()
    except (TypeError, ValueError):  # a class whose signature cannot be read: no names, the refusal stands
        parameters = ()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    options = [parameter.name for parameter in parameters if parameter.kind in named]
    return options, kind.__name__ if inspect.isclass(kind) else ""


def _shown(value: Any) -> str:
    """A given value as a config writes it: ``0.05``, ``[0.05, 'strict']``, ``null``, ``true``.

    Examples:
        >>> print(_shown([0.05, "strict", None, True]))
        [0.05, 'strict', null, true]
    """
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(_shown, value))}]"
    return repr(value)


def unparsable_config_line(error: BaseException | None, args: typing.Sequence[str]) -> str | None:
    """A config that is not YAML, as one line naming the file (the first file named in ``args``, by ``--config``,
    ``-c`` or a group's own file, that YAML cannot read; else "a config file"), the line and the column; ``None``
    when no YAML error caused ``error``.

    Examples:
        >>> import yaml
        >>> try:
        ...     yaml.safe_load("trainer:" + chr(10) + "  max_steps: [" + chr(10))
        ... except yaml.YAMLError as error:
        ...     print(unparsable_config_line(error, ["fit"]))  # doctest: +NORMALIZE_WHITESPACE
        a config file, line 3, column 1: while parsing a flow node, expected the node content,
        but found '<stream end>' (not YAML)
    """
    while error is not None and getattr(error, "problem_mark", None) is None:
        error = error.__cause__ or error.__context__
    if error is None:
        return None
    given = [arg.partition("=")[2] if arg.startswith("-") else arg for arg in args]  # --trainer=t.yaml, -c x.yaml
    named = next((path for path in given if os.path.isfile(path) and not _reads_as_yaml(path)), "a config file")
    mark, said = error.problem_mark, ", ".join(filter(None, (error.context, error.problem)))
    return f"{named}, line {mark.line + 1}, column {mark.column + 1}: {said} (not YAML)"


def _reads_as_yaml(path: str) -> bool:
    """Whether the file ``path`` holds YAML (``True`` when it cannot be read: not the one)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            yaml.safe_load(file)
    except yaml.YAMLError:
        return False
    except (OSError, UnicodeDecodeError):
        return True
    return True


def _group_holding(class_path: str, field: str) -> str | None:
    """The argument of ``class_path``'s constructor whose dataclass (an options group) has ``field``, if any."""
    made = pydoc.locate(class_path)
    try:
        hints = typing.get_type_hints(made.__init__) if isinstance(made, type) else {}
    except Exception:  # a hint that does not resolve: no suggestion, the error stands as it is
        return None
    for argument, hint in hints.items():
        for kind in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(kind) and field in {f.name for f in dataclasses.fields(kind)}:
                return argument
    return None


def missing_package(error: BaseException) -> ImportError | None:
    """The ImportError that caused ``error`` (jsonargparse wraps one raised while making a class), if any; only
    explicit causes (``raise ... from``) count: an ImportError merely being handled is not what went wrong."""
    return next((cause for cause in _causes(error) if isinstance(cause, ImportError)), None)


def _causes_and_contexts(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then what caused it and what it was raised while handling (each once), causes first."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        error = pending.pop()
        if error is not None and id(error) not in seen:
            seen.add(id(error))
            yield error
            pending += [error.__context__, error.__cause__]


def _causes(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then its explicit causes (``__cause__``), each once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__


def _made_by_this_package(error: BaseException) -> object | None:
    """The object whose constructor (``__init__``, or a dataclass's ``__post_init__``) in this package raised
    ``error``: the outermost such frame of its traceback."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        code = frame.f_code
        in_package = os.path.realpath(code.co_filename).startswith(_PACKAGE_DIR)  # imported as benchmarks/../ too
        if code.co_name in ("__init__", "__post_init__") and in_package:
            return frame.f_locals.get("self")
    return None


def _config_key_of(config: Any, made: object) -> str | None:
    """Where ``config`` gives the class of ``made``: ``model``, ``trainer.callbacks[0]``, ``...corrections[1]``: a
    ``class_path`` naming its class marks it, or, for a dataclass given by its fields, those fields' values."""
    for key, node in _config_nodes(config, ""):
        if not isinstance(node, Namespace):
            continue
        fields = {name: value for name, value in vars(node).items() if not name.startswith("__")}  # not __path__
        class_path = fields.get("class_path")
        if isinstance(class_path, str):
            module, _, name = class_path.rpartition(".")
            if getattr(sys.modules.get(module), name, None) is type(made):
                return key
        elif dataclasses.is_dataclass(made) and fields and all(_holds(made, *item) for item in fields.items()):
            return key
    return None


def _holds(made: object, field: str, value: Any) -> bool:
    """Whether ``made`` holds ``value`` as ``field`` (``False`` for what cannot be compared, arrays for instance)."""
    try:
        return bool(hasattr(made, field) and getattr(made, field) == value)
    except (TypeError, ValueError, RuntimeError):
        return False


def _config_nodes(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` for ``value`` and everything in it, keys as a config names them (``trainer.callbacks[0]``)."""
    yield key, value
    if isinstance(value, Namespace):
        for name, item in vars(value).items():
            yield from _config_nodes(item, f"{key}.{name}" if key else name)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _config_nodes(item, f"{key}[{index}]")
