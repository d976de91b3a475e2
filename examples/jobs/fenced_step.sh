#!/bin/sh
# One partition's job under `tenure run`, in plain shell and psql: every step appends a row to
# job_log in the same statement that checks the partition's fence, so a step made under an old
# token is refused however late it arrives. The fence rule is tenure's own: the row of
# tenure_fence is raised to this token unless it already holds a higher one (`<=`, so one owner
# writes many times under one token), and the data row is inserted only if it was.
#
# tenure run gives: TENURE_PARTITION, TENURE_TOKEN (and the hash range, the lease TTL, the
# worker's name). The caller gives JOB_DATABASE, a libpq connection string.
set -u
step=0
while :; do
  step=$((step + 1))
  row=$(psql "$JOB_DATABASE" -X -qtA -v ON_ERROR_STOP=1 -c "
    WITH fence AS (
      INSERT INTO tenure_fence (partition, fence_token) VALUES ($TENURE_PARTITION, $TENURE_TOKEN)
      ON CONFLICT (partition) DO UPDATE SET fence_token = EXCLUDED.fence_token
      WHERE tenure_fence.fence_token <= EXCLUDED.fence_token
      RETURNING partition
    )
    INSERT INTO job_log (partition, token, step)
    SELECT partition, $TENURE_TOKEN, $step FROM fence
    RETURNING step") || exit 1
  if [ "$row" = "$step" ]; then
    echo "ACCEPT partition=$TENURE_PARTITION token=$TENURE_TOKEN step=$step"
  else
    # A newer owner raised the fence: this process is a straggler and must stop.
    echo "REFUSED partition=$TENURE_PARTITION token=$TENURE_TOKEN step=$step"
    exit 3
  fi
  sleep 0.2
done
