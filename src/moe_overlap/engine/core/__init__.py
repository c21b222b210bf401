"""The schedule core: what runs a schedule, and nothing that checks one.

Step data (the schedule as typed values), the one runner of a macro step, the nodes and
plans it runs, streams and events (CPU stand-ins included), and the state nodes hand each
other. Each floor imports only the floors below it::

    _guard           the Guard Protocol: what a check attached to the core implements
    _chunk_plan      a model chunk of one microbatch: pre-process, layer plans, post-process
    _runner          the one runner: any macro step (F, B, F+B, F+F, B+B) of chunk plans
    _layer_plan      one layer of one microbatch, cut into slot nodes
    _executor        the step walker: a step list, each step on its role's plan
    _layer_node      a layer slot's node: node.detach, delayed wgrad, post-hooks
    _process_nodes   pre- and post-process nodes      _backward_dw  pre-dispatch wgrad
    _node            the base node: forward on a stream between events, backward
    _wgrad_claims    which delayed modules a schedule computes the wgrad of
    _free_input      the free-input policy            _layer_args   what a layer node knows
    _steps _state    steps and shapes; chunk and layer state; options (and the paired
    _options         orders, _order, below them); a whole node schedule as data
                     (_node_schedule)
    _streams         streams and events, CUDA or CPU, and each device's default pair
    _node_errors     what a node raises itself
    _hooks           the hook lists (_arguments: the data types' own); the stream
                     model's observer and delay hooks
                     (_stream_observer), slot kinds (_kinds)

It imports no check: only itself, the standard library, torch, typing_extensions and the
shared top-level modules :mod:`moe_overlap.protocols` (the Protocols a model, a layer and an
observer implement), :mod:`moe_overlap.args` (argument specs, ``check_arg``),
:mod:`moe_overlap.errors` (the error hierarchy) and :mod:`moe_overlap.microbatch` (the
inputs a plan is built from), which define what they show and import nothing of the package
when imported but each other (``tests/engine/test_core.py``). The checks
(``engine/_attached_checks.py`` and the modules it calls) attach to it from outside: as
guards on the hook lists of ``_hooks``, each a ``Guard`` (``_guard``), and the stream-order
checker as the CPU stream model's observer (``_stream_observer``); race shaking
(``engine/_stream_shake.py``) attaches its delays there too. The core calls each attached
guard at a fixed point; a hook with none attached costs one empty-list test. Every check of
what it is given is a guard, the always-on ones too (the argument specs of its data types,
``engine/_core_args.py``; a macro step's plans and gradients, ``engine/_step_checks.py``):
without guards nothing is checked. What checks a
schedule before the runner runs it stays outside: the exactness rules of a whole node
schedule with the order each microbatch keeps (``engine/_node_order_check.py``), and the
enumeration of the orders a paired run allows (``engine/_order_search.py``). So does what
only the driver or a check reads: the driver's microbatch orders
(``engine/_microbatch_order.py``: which macro steps ``combined_1f1b`` runs) and the macro
steps as data (``engine/_macro_steps.py``: their microbatches, their text), the registry
that attaches a guard to its hooks' lists (``engine/_guards.py``) and the inputs a
recomputed region holds (``engine/_recompute_hold.py``, read by the free-input guard).
And what only a caller asks for, on the core's runner and streams: two forwards or two
backwards run by hand (``engine/_run_pair.py``), streams and events made for a device it
names, the device checked, and its default pair set (``engine/_stream_setup.py``), the
context-manager form of a node's stream steps and a stream's wait for another
(``engine/_use_stream.py``) and a bound method
held weakly (``engine/_weak_method.py``).

Its modules are private to the engine.
"""

__all__: list[str] = []
