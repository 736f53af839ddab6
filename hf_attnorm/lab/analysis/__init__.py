"""Analyses of attention scales: ``scale_analysis`` (length-scaling arguments, empirical alpha*), ``capture``
(q/k as the attention function receives them), ``scale_plots`` (figures)."""

from .capture import capture_attention
from .scale_analysis import (
    AnalyticAlpha,
    CurveFit,
    EmpiricalAlpha,
    McRow,
    ScoreRows,
    analytic_alpha,
    collect_score_rows,
    empirical_alpha,
    irrelevant_mass,
    mass_table,
    mc_check,
    mc_objective,
    mc_optimal_alpha,
    mgf_optimal_alpha,
    model_mc_alpha,
    worked_examples,
)

__all__ = [
    "AnalyticAlpha",
    "CurveFit",
    "EmpiricalAlpha",
    "McRow",
    "ScoreRows",
    "analytic_alpha",
    "capture_attention",
    "collect_score_rows",
    "empirical_alpha",
    "irrelevant_mass",
    "mass_table",
    "mc_check",
    "mc_objective",
    "mgf_optimal_alpha",
    "mc_optimal_alpha",
    "model_mc_alpha",
    "worked_examples",
]
