"""The built-in detectors, one module per pathology (or small family of them); each registers its
detectors with :func:`grpolens.analysis.doctor.catalogue.detector` on import. Their statistics and
thresholds are module constants, documented in ``docs/doctor.md``."""
