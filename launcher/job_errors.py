"""The error a job ends with when it cannot run or finish: one line for the user, no traceback.

Its own module because both the session (which runs the cluster) and the run record (which
writes the run directory) raise it, and the run record is imported by the session.
"""

from __future__ import annotations


class JobError(Exception):
    """A one-line reason the job could not run or finish."""


class BadInputError(JobError):
    """A job refused, before anything started, for what the user named (a --resume folder that
    is not a run): exit 2 like a bad YAML, where a job that fails exits 1."""
