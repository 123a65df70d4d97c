"""dprec's Apache Beam jobs."""
import logging


class _NoApitoolsNotice(logging.Filter):
  """Drops the notice Beam logs through the root logger when it is imported without Google
  Cloud's client libraries ("apitools not found ..."): no dprec job uses them."""

  def filter(self, record):
    return not str(record.msg).startswith("apitools not found")


logging.getLogger().addFilter(_NoApitoolsNotice())
