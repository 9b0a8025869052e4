// Checks deploy/k8s: every document validates against its schema
// (kubernetes-models), and the files agree with each other, with
// deploy/prometheus/prometheus-k8s.yml and with deploy/docker/Dockerfile.
// Usage: node k8s_manifests_test.js SOURCE_DIR SECRETS.yaml
// (SECRETS.yaml: what deploy/k8s/gen-secrets.sh wrote for this run)
'use strict';
const fs = require('fs');
const path = require('path');
const yaml = require('js-yaml');

const root = process.argv[2];
const dir = path.join(root, 'deploy/k8s');
const failures = [];
function check(ok, what) {
  console.log((ok ? 'ok   ' : 'FAIL ') + what);
  if (!ok) failures.push(what);
}

// The model class for an apiVersion/kind.
function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes('/') ? apiVersion.split('/') : ['', apiVersion];
  const candidates = group === 'monitoring.coreos.com'
    ? [`@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`]
    : [`kubernetes-models/${group ? group + '/' : ''}${version}/${kind}`];
  for (const c of candidates) {
    try { return require(c)[kind]; } catch (e) { /* next */ }
  }
  return null;
}

// --- schemas
const docs = [];
const files = fs.readdirSync(dir).filter((f) => f.endsWith('.yaml') && f !== 'kustomization.yaml').sort();
for (const f of files) {
  for (const d of yaml.loadAll(fs.readFileSync(path.join(dir, f), 'utf8'))) {
    if (!d) continue;
    d.__file = f;
    docs.push(d);
    const Model = modelFor(d.apiVersion, d.kind);
    check(Model !== null, `${f}: ${d.apiVersion} ${d.kind} is a known kind`);
    if (!Model) continue;
    const clean = JSON.parse(JSON.stringify(d));
    delete clean.__file;
    try {
      new Model(clean).validate();
      check(true, `${f}: ${d.kind}/${d.metadata.name} matches the schema`);
    } catch (e) {
      check(false, `${f}: ${d.kind}/${d.metadata.name}: ${e.message}`);
    }
  }
}
// The Secrets gen-secrets.sh makes: valid, and what the workloads mount.
const secrets = [];
for (const d of yaml.loadAll(fs.readFileSync(process.argv[3], 'utf8'))) {
  if (!d) continue;
  secrets.push(d);
  try {
    new (modelFor('v1', 'Secret'))(d).validate();
    check(true, `gen-secrets.sh: Secret/${d.metadata.name} matches the schema`);
  } catch (e) {
    check(false, `gen-secrets.sh: Secret/${d.metadata.name}: ${e.message}`);
  }
  if (d.type === 'kubernetes.io/tls') {
    const cert = Buffer.from(d.data['tls.crt'], 'base64').toString();
    check(cert.includes('BEGIN CERTIFICATE') && d.data['ca.crt'] && d.data['tls.key'],
          `Secret/${d.metadata.name} holds ca.crt, tls.crt and tls.key`);
  }
}
const kust = yaml.load(fs.readFileSync(path.join(dir, 'kustomization.yaml'), 'utf8'));
check(JSON.stringify([...kust.resources].sort()) === JSON.stringify(files),
      `kustomization.yaml lists every manifest: ${kust.resources.join(', ')}`);

// --- cross-file agreement
const byKind = (k) => docs.filter((d) => d.kind === k);
const workloads = docs.filter((d) => ['StatefulSet', 'Deployment'].includes(d.kind));
const services = byKind('Service');
const matches = (selector, labels) => Object.entries(selector).every(([k, v]) => labels[k] === v);

for (const d of docs) {
  const labels = d.metadata.labels || {};
  check(labels['app.kubernetes.io/part-of'] === 'fulcrum', `${d.kind}/${d.metadata.name} is labelled part-of=fulcrum`);
  if (d.kind !== 'Namespace') check(d.metadata.namespace === 'fulcrum', `${d.kind}/${d.metadata.name} is in namespace fulcrum`);
}

const flag = (args, name) => {
  const a = args.find((x) => x.startsWith(`--${name}=`));
  return a === undefined ? undefined : a.slice(name.length + 3);
};
const portOf = (hostport) => Number(hostport.slice(hostport.lastIndexOf(':') + 1));

const roles = {};
for (const w of workloads) {
  const tmpl = w.spec.template;
  const labels = tmpl.metadata.labels;
  check(matches(w.spec.selector.matchLabels, labels), `${w.kind}/${w.metadata.name}: selector matches its pod labels`);
  const role = labels['app.kubernetes.io/component'];
  roles[role] = w;
  const c = tmpl.spec.containers[0];
  const ports = Object.fromEntries((c.ports || []).map((p) => [p.name, p.containerPort]));
  const args = c.args || [];
  check(ports.metrics !== undefined, `${w.metadata.name}: has a container port named metrics`);
  check(portOf(flag(args, 'metrics_addr') || ':0') === ports.metrics,
        `${w.metadata.name}: --metrics_addr port ${flag(args, 'metrics_addr')} = metrics port ${ports.metrics}`);
  if (flag(args, 'listen') !== undefined) {
    check(portOf(flag(args, 'listen')) === ports.grpc, `${w.metadata.name}: --listen port = grpc port ${ports.grpc}`);
  }
  for (const probe of [c.readinessProbe, c.livenessProbe]) {
    check(probe !== undefined, `${w.metadata.name}: has readiness and liveness probes`);
    if (!probe) continue;
    if (probe.grpc) check(probe.grpc.port === ports.grpc, `${w.metadata.name}: gRPC health probe on the grpc port`);
    if (probe.httpGet) {
      check(ports[probe.httpGet.port] !== undefined && probe.httpGet.path === '/healthz',
            `${w.metadata.name}: HTTP probe on /healthz of a named port (${probe.httpGet.port})`);
    }
  }
  // The coordinator's address: a Service of this namespace, on its grpc port.
  const coord = flag(args, 'coordinator');
  if (coord !== undefined) {
    const svc = services.find((s) => coord.startsWith(`${s.metadata.name}.fulcrum.svc`));
    check(svc !== undefined && svc.metadata.name === 'fulcrum-coordinator', `${w.metadata.name}: --coordinator=${coord} names the coordinator Service`);
    if (svc) check(svc.spec.ports.find((p) => p.name === 'grpc').port === portOf(coord), `${w.metadata.name}: --coordinator port = the Service's grpc port`);
  }
  const adv = flag(args, 'advertise');
  if (adv !== undefined) {
    check(adv.startsWith(`$(POD_NAME).${w.spec.serviceName}.fulcrum.svc`) && portOf(adv) === ports.grpc,
          `${w.metadata.name}: --advertise is the pod's stable DNS name on the grpc port`);
    check((c.env || []).some((e) => e.name === 'POD_NAME' && e.valueFrom.fieldRef.fieldPath === 'metadata.name'),
          `${w.metadata.name}: POD_NAME comes from the pod's name`);
  }
  if (w.kind === 'StatefulSet') {
    const svc = services.find((s) => s.metadata.name === w.spec.serviceName);
    check(svc !== undefined && svc.spec.clusterIP === 'None', `${w.metadata.name}: serviceName ${w.spec.serviceName} is a headless Service`);
    const claim = w.spec.volumeClaimTemplates[0].metadata.name;
    check((c.volumeMounts || []).some((m) => m.name === claim && m.mountPath === flag(args, 'data_dir')),
          `${w.metadata.name}: its persistent volume is mounted at --data_dir`);
  }
  // Mutual TLS: the role's Secret mounted where the --tls_* flags point;
  // the coordinator's token file from its Secret.
  const mounted = (flagValue) => (c.volumeMounts || []).some((m) => {
    const v = (tmpl.spec.volumes || []).find((x) => x.name === m.name);
    if (!v || !v.secret || !flagValue || !flagValue.startsWith(m.mountPath + '/')) return false;
    const secret = secrets.find((x) => x.metadata.name === v.secret.secretName);
    return secret !== undefined && secret.data[flagValue.slice(m.mountPath.length + 1)] !== undefined;
  });
  for (const f of ['tls_ca_file', 'tls_cert_file', 'tls_key_file']) {
    check(mounted(flag(args, f)), `${w.metadata.name}: --${f}=${flag(args, f)} is a key of a mounted gen-secrets.sh Secret`);
  }
  check((tmpl.spec.volumes || []).some((v) => v.secret && v.secret.secretName === `fulcrum-tls-${role}`),
        `${w.metadata.name}: mounts its role's certificate fulcrum-tls-${role}`);
  check(!args.includes('--insecure'), `${w.metadata.name}: not --insecure`);
  if (role === 'coordinator') check(mounted(flag(args, 'token_file')), `${w.metadata.name}: --token_file is mounted from a Secret`);
  check(tmpl.spec.securityContext && tmpl.spec.securityContext.fsGroup === 10001 &&
        tmpl.spec.securityContext.runAsUser === 10001, `${w.metadata.name}: runs as the image's user, Secrets readable by fsGroup`);
  for (const v of tmpl.spec.volumes || []) {
    if (v.persistentVolumeClaim) {
      check(byKind('PersistentVolumeClaim').some((p) => p.metadata.name === v.persistentVolumeClaim.claimName),
            `${w.metadata.name}: claim ${v.persistentVolumeClaim.claimName} is defined`);
    }
  }
}
check(JSON.stringify(Object.keys(roles).sort()) === '["coordinator","server","worker"]', 'a workload per role');
check(roles.coordinator && roles.coordinator.kind === 'StatefulSet' && roles.server && roles.server.kind === 'StatefulSet',
      'coordinator and servers are StatefulSets');
check(roles.worker && roles.worker.kind === 'Deployment' &&
      roles.worker.spec.template.spec.containers[0].resources.limits['nvidia.com/gpu'] >= 1,
      'workers are a Deployment requesting nvidia.com/gpu');

for (const s of services) {
  const w = workloads.find((x) => matches(s.spec.selector, x.spec.template.metadata.labels));
  check(w !== undefined, `Service ${s.metadata.name} selects a workload`);
  if (!w) continue;
  const ports = Object.fromEntries(w.spec.template.spec.containers[0].ports.map((p) => [p.name, p.containerPort]));
  for (const p of s.spec.ports) {
    check(ports[p.targetPort] === p.port, `Service ${s.metadata.name} port ${p.name} ${p.port} -> ${w.metadata.name}:${p.targetPort}`);
  }
}

const pm = byKind('PodMonitor')[0];
check(pm !== undefined, 'a PodMonitor');
if (pm) {
  for (const w of workloads) {
    check(matches(pm.spec.selector.matchLabels, w.spec.template.metadata.labels), `PodMonitor selects ${w.metadata.name}`);
  }
  check(pm.spec.podMetricsEndpoints.every((e) => e.port === 'metrics' && e.honorLabels === true), 'PodMonitor scrapes port metrics with honorLabels');
}

// Prometheus without the Operator: DNS names and ports of the Services.
const prom = yaml.load(fs.readFileSync(path.join(root, 'deploy/prometheus/prometheus-k8s.yml'), 'utf8'));
for (const sc of prom.scrape_configs) {
  for (const sd of sc.dns_sd_configs || []) {
    for (const name of sd.names) {
      const svc = services.find((s) => name === `${s.metadata.name}.fulcrum.svc.cluster.local`);
      check(svc !== undefined && svc.spec.clusterIP === 'None', `${sc.job_name}: ${name} is a headless Service`);
      if (svc) check(svc.spec.ports.find((p) => p.name === 'metrics').port === sd.port, `${sc.job_name}: port ${sd.port} is ${svc.metadata.name}'s metrics port`);
    }
  }
  check(sc.honor_labels === true, `${sc.job_name}: honor_labels keeps Fulcrum's job label`);
}

// Dashboards ConfigMap: one key per dashboard, each valid JSON.
const cm = byKind('ConfigMap').find((c) => c.metadata.name === 'fulcrum-dashboards');
const dashFiles = fs.readdirSync(path.join(root, 'deploy/grafana/dashboards')).sort();
check(cm && JSON.stringify(Object.keys(cm.data).sort()) === JSON.stringify(dashFiles), `dashboards ConfigMap holds ${dashFiles.join(', ')}`);
if (cm) for (const [k, v] of Object.entries(cm.data)) check(JSON.parse(v).uid !== undefined, `ConfigMap ${k} parses as a dashboard`);

// The image: every command the manifests run is a binary the Dockerfile installs.
const dockerfile = fs.readFileSync(path.join(root, 'deploy/docker/Dockerfile'), 'utf8');
for (const w of workloads) {
  const cmd = w.spec.template.spec.containers[0].command[0];
  check(cmd.startsWith('/usr/local/bin/') && dockerfile.includes(`/${path.basename(cmd)} `) ,
        `${w.metadata.name}: ${cmd} is built into the image`);
}
for (const p of ['7000', '7070', '9400', '9401', '9402']) check(new RegExp(`EXPOSE.*\\b${p}\\b`).test(dockerfile), `Dockerfile exposes ${p}`);

if (failures.length) {
  console.log(`${failures.length} check(s) failed`);
  process.exit(1);
}
console.log('all checks passed');
