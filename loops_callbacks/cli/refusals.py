"""What the command refuses in one line: a config the parser refused and a value a constructor of this package
refused (each with its config key, exit 2), and a missing optional package (exit 1).

The parser's refusal is read from jsonargparse's exceptions and the frames that raised them (``_ErrorPath``: which
action's key, which ``class_path``, which alternative of a union), never by matching its messages' text, so a
reworded message still gives the keys, the class and the problem; a constructor's from its own ``ValueError`` /
``TypeError`` (``refusal_line``).

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
import sys
import traceback
import typing
from collections.abc import Iterator
from typing import Any

import jsonargparse
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


def parse_error_line(message: str, error: BaseException | None = None, problem: tuple[str, str] | None = None) -> str:
    """jsonargparse's refusal as one line, read from its exceptions, never from its messages' wording: the keys and
    the classes down to the problem (``_ErrorPath``), then what the type check said of the value (where a union of
    types was tried, the alternative that reached a class, else the first), the value, and where an option that is
    not accepted belongs when it is a field of one of the class's groups. ``problem``: ``(key, what to say)``
    instead of the problem, when it is the innermost key's. Without an exception (argparse's own refusals), the
    message in one line.

    Examples:
        >>> print(parse_error_line("unrecognized arguments:" + chr(10) + "  --no_such_flag 1"))
        unrecognized arguments: --no_such_flag 1
    """
    found = _ErrorPath(error) if error is not None else None
    if found is None or found.leaf is None:
        return " ".join(message.split())
    said = problem[1] if problem is not None and found.innermost == problem[0] else None
    if said is None:
        said = " ".join(str(found.leaf).split())
        if found.value is not _NONE:  # a union's alternative: said without the value, as jsonargparse lists them
            shown = str(found.value)
            said = said.replace(f". Got value: {shown}", "").replace(f" {shown} ", " ")
            said += "" if said.endswith(f": {shown}") else f", got {shown}"
        option = found.not_accepted
        group = _group_holding(found.class_path, option) if option and found.class_path else None
        said += f": it is a field of {group} ({group}: {{{option}: ...}})" if group else ""
        said += ", nor the path of a file holding one" if found.not_a_file else ""
    return f"{found.path}: {said}" if found.path else said


_NONE = object()  # no value shown


class _ErrorPath:
    """What a jsonargparse refusal went through, from its exceptions and the frames they were raised in: each key
    (an action's ``dest``) and class (``class_path``) on the way, in order (``path``), the innermost key, and the
    exception that says what is wrong (``leaf``), with the value a union of types refused (``value``), the option
    that is not accepted (``not_accepted``) and whether a string was first read as the path of a file
    (``not_a_file``)."""

    _CHECKS = ("_check_type", "_check_value_key", "_load_config")  # jsonargparse's checks of one key's value

    def __init__(self, error: BaseException) -> None:
        self.path, self.innermost, self.class_path, self.not_accepted = "", "", None, None
        self.leaf: BaseException | None = None
        self.value, self.not_a_file, seen, current = _NONE, False, set(), error
        while self.leaf is None:
            frames = _frames(current)
            for frame in frames:
                if id(frame) not in seen:
                    seen.add(id(frame))
                    self._read(frame)
            site = frames[-1] if frames else None
            alternatives = site.f_locals.get("exceptions") if site else None
            if isinstance(alternatives, list) and alternatives:  # a union of types: each alternative's refusal
                self.value = site.f_locals.get("val", _NONE)
                current = next((one for one in alternatives if _reads_class(*_causes(one))), alternatives[0])
            elif current.__cause__ is not None and site and site.f_code.co_filename.startswith(_JSONARGPARSE) and (
                    site.f_code.co_name in (*self._CHECKS, "error") or _reads_class(current)):
                current = current.__cause__  # it only adds a key, a class or a file that was no file to its cause
            else:
                self.leaf = current
                if isinstance(current, KeyError) and site:  # jsonargparse's NSKeyError: the option not accepted
                    self.not_accepted = site.f_locals.get("key")

    def _read(self, frame: Any) -> None:
        """The key or the class a frame of jsonargparse's checked."""
        name, local = frame.f_code.co_name, frame.f_locals
        if not frame.f_code.co_filename.startswith(_JSONARGPARSE):
            return
        if isinstance(local.get("class_path"), str) and name not in self._CHECKS:
            self.class_path, self.value = local["class_path"], _NONE
            self.path += f" ({self.class_path.rpartition('.')[2]})"
        elif name in self._CHECKS:
            key = local.get("key") if name == "_check_value_key" else getattr(local.get("self"), "dest", None)
            if isinstance(key, str) and key != self.innermost:
                self.path, self.innermost = self.path + (": " if self.path else "") + key, key
                self.value, self.not_a_file = _NONE, False
            if local.get("enable_path") and isinstance(local.get("orig_val"), str) and local.get("config_path") is None:
                self.not_a_file = True  # a string was read as the path of a file of the value first


_JSONARGPARSE = os.path.dirname(jsonargparse.__file__)


def _frames(error: BaseException) -> list[Any]:
    """The frames ``error`` went through, the one that raised it last."""
    return [frame for frame, _ in traceback.walk_tb(error.__traceback__)]


def _reads_class(*errors: BaseException) -> bool:
    """Whether any of ``errors`` went through the reading of a class (a ``class_path``): of a union's alternatives,
    the one that went that far says what is wrong."""
    return any(isinstance(frame.f_locals.get("class_path"), str) for error in errors for frame in _frames(error))


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
