"""Reference implementations the tests compare the package against, kept out of the package: the greedy
router of earlier versions (``greedy``) and the first-fit schedule (``first_fit``)."""
