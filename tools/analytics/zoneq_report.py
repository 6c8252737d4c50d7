"""The zoneq analytics job as a plain script for spark-submit.

    spark-submit --master spark://host:7077 tools/analytics/zoneq_report.py \
        hdfs:///exports/node1 hdfs:///exports/node2 --out report/

Same arguments as ``zoneq analytics``; zoneq must be importable on the driver (pip install
'zoneq[analytics]', or --py-files with a zip of the package).  Under spark-submit the
session it started is reused, so --master and --conf given to spark-submit apply.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a source checkout

from zoneq.analytics.command import main

if __name__ == "__main__":
    sys.exit(main())
