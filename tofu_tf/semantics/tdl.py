"""The operator description language: what an op computes, as index lambdas.

This module owns the *front end* of the language in which tofu_tf states the
semantics of a TF op -- in the spirit of Tofu's TDL -- and the tracer that
turns a program into a frozen ``tofu_tf.semantics.language.Description``. It
knows nothing about particular ops (``tofu_tf.semantics.ops``), partition
strategies (``derive``) or TensorFlow.

A *program* is a Python lambda over the op's inputs that returns, per output,
an *index lambda*: the output element at some indices as an expression of
input elements::

    MatMul:  lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[k, j])
    Conv2D:  lambda x, f: lambda n, h, w, o: Sum(lambda r, q, c:
                 x[n, h*2 + r - 1, w*2 + q - 1, c] * f[r, q, c, o])
    Softmax: lambda x: lambda i, j: Apply("exp", x[i, j]) / Sum(lambda r: Apply("exp", x[i, r]))
    Gather:  lambda table, ids: lambda b, s, d: table[ids[b, s], d]

Tracing a program on the op's static shapes (``trace``) records every element
access: which input, and per dim an index expression -- affine in indices
(``h*2+r-1``: windows, offsets, ``0`` for a broadcast dim), a digit of one
(``(a*64+s)//16``: reshapes, tiling), a whole dim (``:``) or a coordinate
read from another input (a lookup). A ``Sum`` / ``Max`` / ``Min`` / ``Mean`` /
``Prod`` at the top of an output's expression is a reduction the output can
be split over ("partition-n-reduce"); one nested inside another expression
(the normalizer of a softmax) is internal and its indices are never split.
``Where`` places the value at computed output coordinates (the scatter form
of gradients: ``dx[n, h*2+r, ...] += ...``). ``Position`` and ``Select`` mark
indices whose *global* value the result depends on (a band mask, a stack),
which therefore cannot be split. Index names come from the lambdas'
parameter names, so the text form reads like the program.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
from typing import Callable, Mapping, Sequence

from tofu_tf.semantics.language import (
    Access, Affine, Description, DescriptionError, Digit, DimExpr, Gathered, InputDesc, MetaKind,
    OutputDesc, ReduceKind, Use, Whole)


# -- symbolic indices ------------------------------------------------------------

class _Sym:
    """Arithmetic on indices while a program is traced: builds ``Affine`` and ``Digit``."""

    __slots__ = ()

    def _affine(self) -> Affine:
        raise NotImplementedError

    def __add__(self, other):
        return _SymAffine(_add(self._affine(), _as_affine(other)))

    __radd__ = __add__

    def __sub__(self, other):
        return _SymAffine(_add(self._affine(), _scale(_as_affine(other), -1)))

    def __rsub__(self, other):
        return _SymAffine(_add(_as_affine(other), _scale(self._affine(), -1)))

    def __mul__(self, k):
        if not isinstance(k, int):
            raise DescriptionError(f"an index can only be scaled by an int, not {k!r}")
        return _SymAffine(_scale(self._affine(), k))

    __rmul__ = __mul__

    def __neg__(self):
        return _SymAffine(_scale(self._affine(), -1))

    def __floordiv__(self, k: int):
        return _SymDigit(Digit(self._affine(), k, None))

    def __mod__(self, k: int):
        return _SymDigit(Digit(self._affine(), 1, k))


class Ix(_Sym):
    """An index variable: a lambda parameter of an output, reduction or update."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def _affine(self) -> Affine:
        return Affine(((self.name, 1),), 0)

    def __repr__(self):
        return self.name


class _SymAffine(_Sym):
    __slots__ = ("value",)

    def __init__(self, value: Affine):
        self.value = value

    def _affine(self) -> Affine:
        return self.value


class _SymDigit:
    __slots__ = ("value",)

    def __init__(self, value: Digit):
        self.value = value

    def __floordiv__(self, k: int):
        d = self.value
        if d.mod is not None:
            raise DescriptionError("write (x // a) % b, not (x % b) // a")
        return _SymDigit(Digit(d.base, d.div * k, None))

    def __mod__(self, k: int):
        d = self.value
        return _SymDigit(Digit(d.base, d.div, k if d.mod is None else min(d.mod, k)))


def _as_affine(value) -> Affine:
    if isinstance(value, _Sym):
        return value._affine()
    if isinstance(value, int):
        return Affine((), value)
    raise DescriptionError(f"cannot use {value!r} in an index expression (indices and ints only)")


def _add(a: Affine, b: Affine) -> Affine:
    terms = dict(a.terms)
    for name, c in b.terms:
        terms[name] = terms.get(name, 0) + c
    return Affine(tuple((n, c) for n, c in terms.items() if c), a.offset + b.offset)


def _scale(a: Affine, k: int) -> Affine:
    return Affine(tuple((n, c * k) for n, c in a.terms if c * k), a.offset * k)


# -- expressions -----------------------------------------------------------------

class Expr:
    """A value computed from input elements. Only its structure matters to
    tofu_tf (which elements, which reductions); arithmetic just builds ``Apply``."""

    __slots__ = ()

    def _bin(self, name, other, swap=False):
        args = (other, self) if swap else (self, other)
        return Apply(name, *args)

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __pow__(self, o): return self._bin("pow", o)
    def __neg__(self): return Apply("neg", self)


class Element(Expr):
    """``x[dims]``: one element of an input."""

    __slots__ = ("tensor", "dims")

    def __init__(self, tensor: "TensorArg", dims: Access):
        self.tensor, self.dims = tensor, dims


class Apply(Expr):
    """``name(args...)``: any element-wise function of its arguments."""

    __slots__ = ("name", "args")

    def __init__(self, name: str, *args):
        self.name, self.args = name, args


class _Reduce(Expr):
    __slots__ = ("kind", "names", "body", "sizes")

    def __init__(self, kind: ReduceKind, names: tuple[str, ...], body, sizes: Mapping[str, int]):
        self.kind, self.names, self.body, self.sizes = kind, names, body, sizes


class _Where(Expr):
    __slots__ = ("body", "subs")

    def __init__(self, body, subs: tuple):
        self.body, self.subs = body, subs


class _Fixing(Expr):
    """An expression whose value depends on the global value of some indices."""

    __slots__ = ("names", "args", "label")

    def __init__(self, label: str, names: tuple[str, ...], args: tuple):
        self.label, self.names, self.args = label, names, args


def _reducer(kind: ReduceKind):
    def reduce(fn: Callable, *, names: Sequence[str] | None = None,
               sizes: Mapping[str, int] | None = None) -> Expr:
        params = _param_names(fn, names)
        body = fn(*(Ix(n) for n in params))
        return _Reduce(kind, tuple(params), body, dict(sizes or {}))
    reduce.__name__ = kind.value.capitalize()
    reduce.__doc__ = (f"{kind.value} of ``fn(*indices)`` over fresh indices named after its parameters "
                      "(or ``names`` for ``*args``); ``sizes`` gives extents no access implies.")
    return reduce


Sum = _reducer(ReduceKind.SUM)
Mean = _reducer(ReduceKind.MEAN)
Max = _reducer(ReduceKind.MAX)
Min = _reducer(ReduceKind.MIN)
Prod = _reducer(ReduceKind.PROD)


def Where(value, *placements) -> Expr:
    """Place ``value`` at computed output coordinates: ``placements`` are
    ``(output index, coordinate)`` pairs, the coordinate an index expression,
    an int, or an element of an input (a data-dependent coordinate)."""
    for pair in placements:
        if len(pair) != 2 or not isinstance(pair[0], Ix):
            raise DescriptionError("Where takes (output index, coordinate) pairs")
    return _Where(value, tuple(placements))


def Position(*indices, args=()) -> Expr:
    """A value that depends on the global value of ``indices`` (a mask such
    as ``i >= j``, an iota): those indices are never split."""
    return _Fixing("position", tuple(_index_name(i) for i in indices), tuple(args))


def Select(index: Ix, options: Sequence) -> Expr:
    """``options[index]``: one of several expressions chosen by an index (a stack)."""
    return _Fixing("select", (_index_name(index),), tuple(options))


def _index_name(value) -> str:
    if not isinstance(value, Ix):
        raise DescriptionError(f"expected an index variable, got {value!r}")
    return value.name


class TensorArg:
    """An input while a program is traced: indexing it records an access."""

    __slots__ = ("position", "shape", "op", "accesses")

    def __init__(self, position: int, shape, op: str):
        self.position, self.shape, self.op = position, shape, op
        self.accesses: list[Access] = []

    @property
    def rank(self) -> int:
        self._known()
        return len(self.shape)

    def _known(self):
        if self.shape is None:
            raise DescriptionError(f"{self.op}: input {self.position} has an unknown shape")

    def __getitem__(self, key) -> Element:
        self._known()
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != len(self.shape):
            raise DescriptionError(
                f"{self.op}: input {self.position} has rank {len(self.shape)} (shape {self.shape}) "
                f"but is indexed with {len(key)} coordinates")
        dims = tuple(_dim(k, self.op) for k in key)
        self.accesses.append(dims)
        return Element(self, dims)


def _dim(value, op: str) -> DimExpr:
    if isinstance(value, _Sym):
        return value._affine()
    if isinstance(value, _SymDigit):
        return _simplify_digit(value.value)
    if isinstance(value, int):
        return Affine((), value)
    if isinstance(value, slice) and value == slice(None):
        return Whole()
    if isinstance(value, Element):
        return Gathered(value.tensor.position, value.dims)
    raise DescriptionError(f"{op}: {value!r} is not an index expression, an int, ':' or an input element")


def _simplify_digit(d: Digit) -> DimExpr:
    """``x // 1`` is ``x``; everything else waits for extents (``bind_digit``)."""
    if d.div == 1 and d.mod is None:
        return d.base
    return d


def bind_digit(d: Digit, extent: Mapping[str, int]) -> DimExpr:
    """``d`` with floor division and modulo removed where the index extents
    make that exact: ``(i*256 + j) // 16384 -> i // 64`` when ``j < 256``,
    ``(i*256 + j) % 256 -> j``. Reshapes come out as plain indices where the
    dims line up."""
    base, div = _reduce_div(_drop_unit(d.base, extent) if d.base.terms else d.base, d.div, extent)
    if div != 1:
        lo, hi = base.bounds(extent)
        if 0 <= lo and hi < div:
            return Affine((), 0)
        if d.mod is not None and 0 <= lo and hi // div < d.mod:
            return Digit(base, div, None)
        return Digit(base, div, d.mod)
    if d.mod is None:
        return base
    base = Affine(tuple((n, c) for n, c in base.terms if c % d.mod), base.offset % d.mod)
    lo, hi = base.bounds(extent)
    if 0 <= lo and hi < d.mod:
        return base
    return Digit(base, 1, d.mod)


def _reduce_div(base: Affine, div: int, extent) -> tuple[Affine, int]:
    """Divide ``base`` and ``div`` by the largest ``c`` (a term coefficient
    dividing ``div``) such that the terms not divisible by ``c`` stay in ``[0, c)``."""
    candidates = sorted({c for _, c in base.terms if c > 0 and div % c == 0} | {div}, reverse=True)
    for c in candidates:
        if c == 1:
            break
        rest = Affine(tuple((n, k) for n, k in base.terms if k % c), base.offset)
        lo, hi = rest.bounds(extent)
        if 0 <= lo and hi < c:
            return Affine(tuple((n, k // c) for n, k in base.terms if k % c == 0), 0), div // c
    return base, div


# -- programs and outputs ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Out:
    """An output's index lambda with explicit index names (for ``*idx`` lambdas)."""

    fn: Callable
    names: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Update:
    """A variable the op writes: ``target`` (a resource input) gets ``fn(*indices)``."""

    target: TensorArg
    fn: Callable
    names: tuple[str, ...] | None = None


class _Marker(enum.Enum):
    META = "meta"
    WORKSPACE = "workspace"


META_OUTPUT = _Marker.META            # an output that is metadata (a shape vector): replicated
WORKSPACE_OUTPUT = _Marker.WORKSPACE  # an output that is backend scratch space


@dataclasses.dataclass(frozen=True)
class Program:
    """A description before it meets shapes: ``fn`` takes one ``TensorArg`` per
    input and returns the output index lambdas (one, or a tuple with ``Out``,
    ``Update``, ``META_OUTPUT`` and ``WORKSPACE_OUTPUT`` entries).

    Inputs the program never indexes are metadata (``MetaKind.STATIC``) unless
    listed: ``meta`` for other metadata kinds, ``shape_only`` for inputs whose
    shape alone is read, ``workspace`` for backend scratch inputs;
    ``shape_attrs`` maps attributes that state an output's shape (EnsureShape's
    ``shape``) to that output.
    """

    fn: Callable
    meta: Mapping[int, MetaKind] = dataclasses.field(default_factory=dict)
    shape_only: frozenset[int] = frozenset()
    workspace: frozenset[int] = frozenset()
    shape_attrs: Mapping[str, int] = dataclasses.field(default_factory=dict)


_PARAMETERS_BY_CODE: dict[types.CodeType, tuple[inspect.Parameter, ...]] = {}


def _parameters(fn: Callable) -> tuple[inspect.Parameter, ...]:
    """``inspect.signature(fn).parameters``, kept per code object for plain functions.

    Descriptions are built from fresh lambdas of the same few code objects (one per op
    builder), and ``inspect.signature`` is a tenth of a first description; a plain
    function's parameter names and kinds are its code's. Anything else (partials,
    wrapped or annotated-signature callables) is asked every time."""
    plain = type(fn) is types.FunctionType and not hasattr(fn, "__wrapped__") and not hasattr(fn, "__signature__")
    if not plain:
        return tuple(inspect.signature(fn).parameters.values())
    found = _PARAMETERS_BY_CODE.get(fn.__code__)
    if found is None:
        found = _PARAMETERS_BY_CODE[fn.__code__] = tuple(inspect.signature(fn).parameters.values())
    return found


def _has_star_indices(fn: Callable) -> bool:
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in _parameters(fn))


def _param_names(fn: Callable, names) -> tuple[str, ...]:
    params = _parameters(fn)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        if names is None:
            raise DescriptionError("a lambda over *indices needs explicit names (Out(fn, names=...))")
        return tuple(names)
    found = tuple(p.name for p in params)
    if names is not None and len(names) != len(found):
        raise DescriptionError(f"names {names} do not match the lambda's parameters {found}")
    return tuple(names) if names is not None else found


def default_names(rank: int, taken: str = "") -> tuple[str, ...]:
    """Index names for a ``*idx`` lambda of ``rank`` dims: i, j, k, l, m, ..."""
    pool = [c for c in "ijklmnpquvwxyzabcdefgh" if c not in taken]
    if rank > len(pool):
        return tuple(f"i{d}" for d in range(rank))
    return tuple(pool[:rank])


@dataclasses.dataclass
class _Tracer:
    """Mutable state of one trace (local to ``trace``; nothing global)."""

    op: str
    sizes: dict = dataclasses.field(default_factory=dict)
    fixed: set = dataclasses.field(default_factory=set)
    explicit: dict = dataclasses.field(default_factory=dict)
    reduce_order: list = dataclasses.field(default_factory=list)
    placed: set = dataclasses.field(default_factory=set)

    def size(self, name: str, value: int, where: str):
        old = self.sizes.get(name)
        if old is not None and old != value:
            raise DescriptionError(
                f"{self.op}: index {name!r} has extent {old} and {value} ({where}); "
                "give indices of different extents different names")
        self.sizes[name] = value


def trace(program: Program | Callable, *, op: str, input_shapes, output_shapes,
          variables: Sequence[bool] = ()) -> Description:
    """Run ``program`` on symbolic inputs of the given shapes and return the
    ``Description`` it states. Raises ``DescriptionError`` naming ``op`` when
    the program and the op disagree (arity, ranks, unsized indices)."""
    if not isinstance(program, Program):
        program = Program(program)
    input_shapes = tuple(input_shapes)
    output_shapes = tuple(output_shapes)
    args = [TensorArg(p, s, op) for p, s in enumerate(input_shapes)]
    try:
        result = program.fn(*args)
    except TypeError as exc:
        raise DescriptionError(f"{op}: its program does not take {len(args)} inputs ({exc})") from exc
    entries = result if isinstance(result, (tuple, list)) else (result,)
    updates = [e for e in entries if isinstance(e, Update)]
    outputs = [e for e in entries if not isinstance(e, Update)]
    if len(outputs) != len(output_shapes):
        raise DescriptionError(f"{op}: its program states {len(outputs)} outputs, the op has {len(output_shapes)}")
    tracer = _Tracer(op)
    out_descs = [_trace_output(tracer, entry, k, output_shapes[k]) for k, entry in enumerate(outputs)]
    update_descs = [_trace_update(tracer, u) for u in updates]
    _size_reductions(tracer, args)
    hidden = set()
    in_descs = [_input_desc(program, arg, tracer, hidden) for arg in args]
    for k, u in enumerate(updates):
        in_descs[u.target.position] = dataclasses.replace(in_descs[u.target.position], use=Use.DATA)
    extent = tracer.sizes
    bind = lambda access: tuple(_bind(d, extent) for d in access)
    in_descs = [dataclasses.replace(d, accesses=tuple(bind(a) for a in d.accesses)) for d in in_descs]
    out_descs = [dataclasses.replace(d, access=bind(d.access)) for d in out_descs]
    update_descs = [(p, bind(a)) for p, a in update_descs]
    variable_flags = tuple(variables) + (False,) * (len(args) - len(variables))
    in_descs = [dataclasses.replace(d, variable=v and d.use is Use.DATA) for d, v in zip(in_descs, variable_flags)]
    return Description(
        inputs=tuple(in_descs), outputs=tuple(out_descs),
        input_shapes=tuple(s if s is not None else () for s in input_shapes), output_shapes=output_shapes,
        sizes=tuple(tracer.sizes.items()), fixed=frozenset(tracer.fixed), updates=tuple(update_descs),
        hidden=frozenset(hidden), shape_attrs=tuple(sorted(program.shape_attrs.items())))


def _bind(dim: DimExpr, extent) -> DimExpr:
    if isinstance(dim, Digit):
        return bind_digit(dim, extent)
    if isinstance(dim, Affine) and len(dim.terms) > 1:
        return _drop_unit(dim, extent)
    if isinstance(dim, Gathered):
        return Gathered(dim.source, tuple(_bind(d, extent) for d in dim.at))
    return dim


def _drop_unit(dim: Affine, extent) -> Affine:
    """Leave out indices of extent 1 (always 0) from a sum of several: ``i+j -> i``."""
    kept = tuple((n, c) for n, c in dim.terms if extent.get(n, 2) != 1)
    return Affine(kept or dim.terms[:1], dim.offset)


def _trace_output(tracer: _Tracer, entry, k: int, shape) -> "OutputDesc":
    if entry is _Marker.META:
        return OutputDesc(Use.META)
    if entry is _Marker.WORKSPACE:
        return OutputDesc(Use.WORKSPACE)
    fn, names = (entry.fn, entry.names) if isinstance(entry, Out) else (entry, None)
    if not callable(fn):
        raise DescriptionError(f"{tracer.op}: output {k} is {entry!r}, not an index lambda")
    if names is None and _has_star_indices(fn):
        names = default_names(len(shape))
    params = _param_names(fn, names)
    if len(params) != len(shape):
        raise DescriptionError(
            f"{tracer.op}: output {k} has rank {len(shape)} (shape {shape}) but its lambda takes "
            f"{len(params)} indices {params}")
    expr = fn(*(Ix(n) for n in params))
    access, reduce = _analyze(tracer, expr, params, f"output {k}")
    for name, extent in zip(params, shape):
        if any(d.pure == name for d in access if isinstance(d, Affine)):
            tracer.size(name, extent, f"output {k}")
    return OutputDesc(Use.DATA, access, reduce)


def _trace_update(tracer: _Tracer, update: Update):
    target = update.target
    params = _param_names(update.fn, update.names)
    if len(params) != target.rank:
        raise DescriptionError(f"{tracer.op}: the update of input {target.position} needs {target.rank} indices")
    expr = update.fn(*(Ix(n) for n in params))
    access, reduce = _analyze(tracer, expr, params, f"update of input {target.position}")
    if reduce:
        raise DescriptionError(f"{tracer.op}: an update cannot reduce; reduce into an output instead")
    for name, extent in zip(params, target.shape):
        if any(d.pure == name for d in access if isinstance(d, Affine)):
            tracer.size(name, extent, "update")
    return target.position, access


def _analyze(tracer: _Tracer, expr, params, where: str):
    """Split an output expression into its written coordinates and top-level
    reductions; register nested reductions and position-dependent indices as fixed."""
    reduce: list[tuple[str, ReduceKind]] = []
    subs = {}
    node = expr
    while True:
        if isinstance(node, _Reduce) and (not reduce or node.kind is reduce[0][1]):
            _register_reduce(tracer, node, params)
            reduce += [(n, node.kind) for n in node.names]
        elif isinstance(node, _Where) and not subs:
            for index, coordinate in node.subs:
                if index.name not in params:
                    raise DescriptionError(
                        f"{tracer.op}: Where places {index.name!r}, which is not an index of the {where}")
                subs[index.name] = _dim(coordinate, tracer.op)
        else:
            break
        node = node.body
    _scan(tracer, node, params)
    access = tuple(subs.get(n, Affine(((n, 1),), 0)) for n in params)
    # indices that locate the value (a data-dependent coordinate does not)
    written = {name for dim in access if not isinstance(dim, Gathered) for name in dim.indices()}
    tracer.placed.update(subs)
    reduce = [(n, k) for n, k in reduce if n not in written]
    return access, tuple(reduce)


def _register_reduce(tracer: _Tracer, node: _Reduce, params):
    for name in node.names:
        if name in params:
            raise DescriptionError(f"{tracer.op}: reduction index {name!r} shadows an output index; rename it")
        if name not in tracer.reduce_order:
            tracer.reduce_order.append(name)
    for name, size in node.sizes.items():
        # an extent given by an attribute (a pooling window), not by a tensor: splitting the
        # index would change the attribute, so it stays whole
        tracer.explicit[name] = size
        tracer.fixed.add(name)


def _scan(tracer: _Tracer, node, params):
    if isinstance(node, _Reduce):
        _register_reduce(tracer, node, params)
        tracer.fixed.update(node.names)
        _scan(tracer, node.body, params)
    elif isinstance(node, _Fixing):
        tracer.fixed.update(node.names)
        for arg in node.args:
            _scan(tracer, arg, params)
    elif isinstance(node, Apply):
        for arg in node.args:
            _scan(tracer, arg, params)
    elif isinstance(node, _Where):
        raise DescriptionError(f"{tracer.op}: Where must be the top of an output's expression (under its reductions)")
    elif isinstance(node, (list, tuple)):
        for arg in node:
            _scan(tracer, arg, params)


def _size_reductions(tracer: _Tracer, args: list[TensorArg]):
    """Give each reduction index its explicit ``sizes=`` extent or the extent
    of a dim it indexes exactly; every index read must end up with one."""
    inferred: dict[str, int] = {}
    used: set[str] = set()
    for arg in args:
        for access in arg.accesses:
            for dim, extent in zip(access, arg.shape):
                used.update(dim.indices())
                if isinstance(dim, Affine) and dim.pure is not None:
                    inferred.setdefault(dim.pure, extent)
    for name in tracer.reduce_order:
        size = tracer.explicit.get(name, inferred.get(name, tracer.sizes.get(name)))
        if size is None:
            raise DescriptionError(
                f"{tracer.op}: index {name!r} has no extent: index some input dim with it "
                "alone or pass sizes={...} to its reduction")
        tracer.size(name, size, "reduction")
    placed = used & tracer.placed
    if placed:
        raise DescriptionError(f"{tracer.op}: index {sorted(placed)[0]!r} is placed by Where and also read")
    for name in used:
        if name not in tracer.sizes:
            raise DescriptionError(f"{tracer.op}: index {name!r} is read but is neither an output nor a "
                                   "reduction index")


def _input_desc(program: Program, arg: TensorArg, tracer: _Tracer, hidden: set) -> InputDesc:
    p = arg.position
    if p in program.workspace:
        return InputDesc(Use.WORKSPACE)
    if p in program.shape_only:
        arg._known()
        names = tuple(f"~{p}.{d}" for d in range(len(arg.shape)))
        for name, extent in zip(names, arg.shape):
            tracer.sizes[name] = extent
        hidden.update(names)
        return InputDesc(Use.SHAPE_ONLY, (tuple(Affine(((n, 1),), 0) for n in names),))
    if p in program.meta:
        return InputDesc(Use.META, meta=program.meta[p])
    if not arg.accesses:
        return InputDesc(Use.META, meta=MetaKind.STATIC)
    unique = tuple(dict.fromkeys(arg.accesses))
    return InputDesc(Use.DATA, unique)
