"""``grpolens doctor``: what is wrong with a run, since when, why, and what to change.

Detectors (:mod:`grpolens.analysis.doctor.detectors`, one module per pathology, registered in
:mod:`grpolens.analysis.doctor.catalogue`) read the run's recomputed per-step metrics with the
robust statistics of :mod:`grpolens.analysis.doctor.stats`; each finding's worst step is then
decomposed by ``grpolens explain``. The JSON object (``Report.to_dict()``) is the contract the
dashboard's Findings page reads::

    {"run", "findings": [{"id", "severity", "steps", "metric", "summary", "evidence", "suggestion"}, ...],
     "detectors": [{"id", "status", "why"}, ...]}
"""

from grpolens.analysis.doctor.catalogue import DETECTORS, SEVERITIES, Detector, Finding, Skip, detector, load_detectors
from grpolens.analysis.doctor.diagnose import DetectorStatus, Report, diagnose, load_metrics

__all__ = ["DETECTORS", "SEVERITIES", "Detector", "DetectorStatus", "Finding", "Report", "Skip", "detector",
           "diagnose", "load_detectors", "load_metrics"]
