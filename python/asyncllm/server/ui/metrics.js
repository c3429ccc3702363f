// Reading Prometheus' text format (the server's /metrics) into numbers.

// {name: [{labels, value}]} of every sample in the text.
export function parseMetrics(text) {
  const samples = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/.exec(line);
    if (!match) continue;
    const labels = {};
    for (const pair of (match[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[pair[1]] = pair[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    (samples[match[1]] ??= []).push({ labels, value: Number(match[4]) });
  }
  return samples;
}

// The sum of a metric over its series (engines), or 0 when absent.
export function total(samples, name) {
  return (samples[name] || []).reduce((sum, s) => sum + s.value, 0);
}

// [[upper bound, cumulative count]] of a histogram, summed over its series.
export function buckets(samples, name) {
  const byBound = new Map();
  for (const s of samples[name + "_bucket"] || []) {
    const bound = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
    byBound.set(bound, (byBound.get(bound) || 0) + s.value);
  }
  return [...byBound.entries()].sort((a, b) => a[0] - b[0]);
}

// The q-quantile of the observations between two bucket snapshots (linear within
// a bucket, as Prometheus' histogram_quantile); null when there were none.
export function quantile(q, now, before) {
  const old = new Map(before || []);
  const counts = now.map(([bound, count]) => [bound, count - (old.get(bound) || 0)]);
  const n = counts.length ? counts[counts.length - 1][1] : 0;
  if (n <= 0) return null;
  const rank = q * n;
  let lower = 0;
  let below = 0;
  for (const [bound, count] of counts) {
    if (count >= rank) {
      if (bound === Infinity) return lower;
      const inBucket = count - below;
      return inBucket > 0 ? lower + ((bound - lower) * (rank - below)) / inBucket : bound;
    }
    lower = bound;
    below = count;
  }
  return lower;
}
