"""Recordings and notebooks made into pages (docs/ARCHITECTURE.md): the README's chapter table
and docs/results.md from ``recorded/*.json`` (``results`` and ``results_parts/``), the website
(``site``), Colab cells (``colab``), the notebooks' text checks (``text``), plots and source
views (``plots``, ``show``).
"""
