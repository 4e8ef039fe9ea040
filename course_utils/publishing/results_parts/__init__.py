"""The parts of :mod:`course_utils.publishing.results`, one module per job.

``common`` (the recordings, a headline, number formats) at the bottom; ``headlines_kernels``
(chapters 00-10) and ``headlines_systems`` (chapters 11-14) above it; ``chapters`` (the chapter
list, the README's table); ``renderers`` (``docs/results.md``). Import them through
:mod:`course_utils.publishing.results`, which re-exports the public names and writes the files.
This ``__init__`` imports nothing, so the parts can import each other without a circle.
"""
