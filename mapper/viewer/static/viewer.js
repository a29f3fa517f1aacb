// mapper's live map viewer: the mesh (incremental block deltas), the sensor trajectory, the ESDF slice,
// occupied voxels and the map's live numbers, all from the service's /v1 routes. No build step, no CDN.
import * as THREE from './vendor/three/three.module.min.js';
import { OrbitControls } from './vendor/three/OrbitControls.js';
import { BlockStore, parseBlocks } from './blocks.js';
import { decode, wireArray } from './msgpack.js';

const $ = (id) => document.getElementById(id);
const MESH_POLL_MS = 100; // at most 10 conditional requests a second while the mesh changes
const MESH_IDLE_POLL_MS = 1000; // backed off to this while the service answers 304 (the mesh did not change)
const UNKNOWN_ALPHA = 0; // unobserved slice cells are transparent: the slice does not hide the mesh
const STATUS_POLL_MS = 1000;
const VOXEL_CAP = 50000;
const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
  [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]]; // as mapper.render
const UNKNOWN_RGB = [128, 128, 128];
const INSIDE_RGB = [165, 0, 38];

// ------------------------------------------------------------------------------------------- state
const state = {
  mapId: null, status: null, generation: 0,
  meshVersion: null, meshEtag: null, notModified: 0, meshPollMs: MESH_POLL_MS, fullFetches: 0, deltaFetches: 0, deltaBytes: 0, lastMeshMs: 0, updates: [], undrawn: [],
  trajectory: [], sliceZ: null, sliceHash: null, sliceFetches: 0, sliceError: null,
  voxels: null, errors: [], needToken: false, hasTsdf: true, fitted: false,
};
window.mapperViewer = { state }; // read by the browser test and handy in the console

class ApiError extends Error {
  constructor(status, type, detail) { super(detail); this.status = status; this.type = type; }
}

function token() { return sessionStorage.getItem('mapperToken') || ''; }

async function api(path, { accept = 'application/json', raw = false, response = false, etag = null } = {}) {
  const headers = { Accept: accept };
  if (token()) headers.Authorization = 'Bearer ' + token();
  if (etag) headers['If-None-Match'] = etag; // a conditional poll: 304 while nothing changed
  const r = await fetch(path, { headers, cache: 'no-store' });
  if (r.status === 304 && response) return r;
  if (!r.ok) {
    let type = 'error', detail = r.status + ' ' + r.statusText;
    try { const b = await r.json(); type = b.type || type; detail = b.detail || detail; } catch (e) { /* not JSON */ }
    if (typeof detail !== 'string') detail = JSON.stringify(detail);
    throw new ApiError(r.status, type, detail);
  }
  if (response) return r;
  if (raw) return r.arrayBuffer();
  if (accept === 'application/msgpack') return decode(await r.arrayBuffer());
  return r.json();
}

function message(text, kind = 'notice') {
  const m = $('message');
  m.textContent = text || '';
  m.className = text ? kind : '';
}

function overlay(text) {
  const o = $('overlay');
  o.textContent = text || '';
  o.hidden = !text;
  document.body.dataset.overlay = text ? 'shown' : 'hidden';
}

function authProblem(e) {
  if (e instanceof ApiError && (e.status === 401 || e.status === 403)) {
    state.needToken = true;
    $('token-row').hidden = false;
    const text = token() ? 'The token was refused: ' + e.message : 'This service needs a token: ' + e.message;
    message(text, 'error');
    overlay(text);
    return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------- three.js
let renderer, scene, camera, controls, meshGroup, material, sliceMesh, trajLine, sensorMarker, voxelMesh;
let axes, groundGrid;
let renderPending = false;

function requestRender() {
  if (renderPending || !renderer) return;
  renderPending = true;
  requestAnimationFrame(() => {
    renderPending = false;
    controls.update();
    renderer.render(scene, camera);
    state.frames = (state.frames || 0) + 1;
    const now = Date.now();
    for (const u of state.undrawn) u.drawnWall = now; // the frame showing the update was submitted
    state.undrawn.length = 0;
    // ms from navigation to the first frame drawn with the first mesh (benchmarks/bench_viewer.py reads it)
    if (state.meshShownMs === undefined && store.triangles > 0) {
      renderer.getContext().finish();
      state.meshShownMs = performance.now();
    }
  });
}

const VERT = `
attribute vec3 rgb;
uniform int mode;
uniform vec2 zrange;
varying vec3 vColor;
varying vec3 vNormal;
vec3 viridis(float t) {
  t = clamp(t, 0.0, 1.0);
  const vec3 c0 = vec3(0.2777273272234177, 0.005407344544966578, 0.3340998053353061);
  const vec3 c1 = vec3(0.1050930431085774, 1.404613529898575, 1.384590162594685);
  const vec3 c2 = vec3(-0.3308618287255563, 0.214847559468213, 0.09509516302823659);
  const vec3 c3 = vec3(-4.634230498983486, -5.799100973351585, -19.33244095627987);
  const vec3 c4 = vec3(6.228269936347081, 14.17993336680509, 56.69055260068105);
  const vec3 c5 = vec3(4.776384997670288, -13.74514537774601, -65.35303263337234);
  const vec3 c6 = vec3(-5.435455855934631, 4.645852612178535, 26.3124352495832);
  return c0 + t * (c1 + t * (c2 + t * (c3 + t * (c4 + t * (c5 + t * c6)))));
}
void main() {
  if (mode == 0) vColor = rgb;
  else if (mode == 1) vColor = viridis((position.z - zrange.x) / max(zrange.y - zrange.x, 1e-6));
  else vColor = normal * 0.5 + 0.5;
  vNormal = normalize(normalMatrix * normal);
  gl_Position = projectionMatrix * modelViewMatrix * vec4(position, 1.0);
}`;
const FRAG = `
varying vec3 vColor;
varying vec3 vNormal;
void main() {
  float light = 0.35 + 0.65 * abs(normalize(vNormal).z);  // a head light, both faces lit
  gl_FragColor = vec4(vColor * light, 1.0);
}`;

function initThree() {
  const view = $('view');
  try {
    renderer = new THREE.WebGLRenderer({ antialias: false, preserveDrawingBuffer: true });
  } catch (e) {
    overlay('WebGL is not available in this browser: ' + e.message);
    throw e;
  }
  renderer.setPixelRatio(Math.min(window.devicePixelRatio || 1, 2));
  view.prepend(renderer.domElement);
  scene = new THREE.Scene();
  scene.background = new THREE.Color(0x15181c);
  camera = new THREE.PerspectiveCamera(50, 1, 0.05, 5000);
  camera.up.set(0, 0, 1);
  camera.position.set(6, -8, 6);
  controls = new OrbitControls(camera, renderer.domElement);
  controls.addEventListener('change', requestRender);
  meshGroup = new THREE.Group();
  scene.add(meshGroup);
  material = new THREE.ShaderMaterial({
    vertexShader: VERT, fragmentShader: FRAG, side: THREE.DoubleSide,
    uniforms: { mode: { value: 1 }, zrange: { value: new THREE.Vector2(0, 1) } },
  });
  axes = new THREE.AxesHelper(1); // x red, y green, z blue, 1 m
  scene.add(axes);
  setGroundGrid(20);
  scene.add(new THREE.HemisphereLight(0xffffff, 0x444444, 0.8)); // for the voxel cubes
  camera.add(new THREE.DirectionalLight(0xffffff, 1.5)); // a head light
  scene.add(camera);
  const resize = () => {
    const w = view.clientWidth, h = view.clientHeight;
    renderer.setSize(w, h, false);
    camera.aspect = w / Math.max(h, 1);
    camera.updateProjectionMatrix();
    requestRender();
  };
  new ResizeObserver(resize).observe(view);
  resize();
}

function clearScene() {
  for (const c of [...meshGroup.children]) { c.geometry.dispose(); meshGroup.remove(c); }
  chunkMeshes.clear();
  store.clear();
  store.dirty.clear();
  for (const o of [sliceMesh, trajLine, sensorMarker, voxelMesh]) {
    if (o) { scene.remove(o); o.geometry.dispose(); if (o.material.map) o.material.map.dispose(); }
  }
  sliceMesh = trajLine = sensorMarker = voxelMesh = null;
  requestRender();
}

// -------------------------------------------------------------------------------------------- mesh
const store = new BlockStore();
const chunkMeshes = new Map();

function updateChunks() {
  for (const chunk of store.dirty) {
    const old = chunkMeshes.get(chunk);
    if (old) { meshGroup.remove(old); old.geometry.dispose(); chunkMeshes.delete(chunk); }
    const a = store.chunkArrays(chunk);
    if (!a || a.index.length === 0) continue;
    const g = new THREE.BufferGeometry();
    g.setAttribute('position', new THREE.BufferAttribute(a.positions, 3));
    g.setAttribute('normal', new THREE.BufferAttribute(a.normals, 3, true));
    if (a.colors) g.setAttribute('rgb', new THREE.BufferAttribute(a.colors, 3, true));
    g.setIndex(new THREE.BufferAttribute(a.index, 1));
    g.computeBoundingSphere();
    const m = new THREE.Mesh(g, material);
    m.matrixAutoUpdate = false;
    meshGroup.add(m);
    chunkMeshes.set(chunk, m);
  }
  store.dirty.clear();
  updateColorMode();
}

function updateColorMode() {
  const sel = $('color-mode').value;
  const mode = sel === 'rgb' || (sel === 'auto' && store.hasColor) ? 0 : sel === 'normal' ? 2 : 1;
  material.uniforms.mode.value = mode === 0 && !store.hasColor ? 1 : mode;
  const b = layerBounds();
  if (b) material.uniforms.zrange.value.set(b.min[2], b.max[2]);
  requestRender();
}

// a ground grid in the z = 0 plane, at least `size` metres across: 1 m cells (coarser past 200 cells, so a
// large map does not draw thousands of lines; GridHelper draws in x-z, turned into x-y)
function setGroundGrid(size) {
  const n = Math.max(2, Math.ceil(size / 2) * 2);
  if (groundGrid && groundGrid.userData.size === n) return;
  if (groundGrid) { scene.remove(groundGrid); groundGrid.geometry.dispose(); }
  groundGrid = new THREE.GridHelper(n, Math.min(n, 200), 0x556070, 0x2c333b);
  groundGrid.rotation.x = Math.PI / 2;
  groundGrid.userData.size = n;
  groundGrid.visible = axes.visible = $('show-grid').checked;
  scene.add(groundGrid);
  state.groundGrid = n;
  document.body.dataset.groundGrid = String(n);
  requestRender();
}

async function fetchMesh(gen) {
  const since = state.meshVersion;
  const q = since === null ? '' : '?since_version=' + since;
  const t0 = performance.now();
  const r = await api('/v1/maps/' + state.mapId + '/mesh/blocks' + q,
    { response: true, etag: since === null ? null : state.meshEtag });
  if (gen !== state.generation) return;
  if (r.status === 304) { // the mesh did not change: nothing to fetch, poll less often
    await r.arrayBuffer(); // (empty) finish the response
    state.notModified++;
    state.meshPollMs = Math.min(MESH_IDLE_POLL_MS, state.meshPollMs * 2);
    state.lastMeshMs = performance.now() - t0;
    return;
  }
  state.meshPollMs = MESH_POLL_MS;
  state.meshEtag = r.headers.get('ETag');
  const buf = await r.arrayBuffer();
  if (gen !== state.generation) return;
  const t1 = performance.now();
  if (state.meshReceivedMs === undefined) state.meshReceivedMs = t1;
  const m = parseBlocks(buf);
  const changed = store.apply(m);
  if (m.full) state.fullFetches++; else { state.deltaFetches++; state.deltaBytes += buf.byteLength; }
  state.meshVersion = m.version;
  if (changed) {
    updateChunks();
    // per update (benchmarks/bench_viewer.py reads them): when (page clock and wall clock), the mesh and map
    // versions shown, its size, the request's round trip and the time to parse, store and upload it
    const t2 = performance.now();
    const u = {
      t: t2, wall: Date.now(), version: m.version, mapVersion: Number(r.headers.get('X-Map-Version')),
      blocks: changed, bytes: buf.byteLength, fetchMs: t1 - t0, applyMs: t2 - t1,
    };
    state.updates.push(u);
    state.undrawn.push(u);
    if (state.updates.length > 200) state.updates.shift();
  }
  state.lastMeshMs = performance.now() - t0;
  state.triangles = store.triangles;
  document.body.dataset.triangles = String(store.triangles);
  document.body.dataset.meshVersion = String(m.version);
  if (!state.fitted && store.triangles > 0) { fitView(); state.fitted = true; }
  if (changed) requestRender();
}

async function meshLoop(gen) {
  while (gen === state.generation && state.hasTsdf) {
    const t0 = performance.now();
    try {
      await fetchMesh(gen);
    } catch (e) {
      if (gen !== state.generation) return;
      if (authProblem(e)) return;
      if (e instanceof ApiError && e.status === 404 && /tsdf/i.test(e.message)) {
        state.hasTsdf = false;
        message('This map has no TSDF layer, so no mesh: showing its occupied voxels and the ESDF slice.');
        $('show-voxels').checked = true;
        $('show-slice').checked = true;
        refreshVoxels(gen);
        refreshSlice(gen);
        return;
      }
      if (e instanceof ApiError && e.status === 404) { showMapError(e); return; }
      reportError('mesh: ' + e.message);
      await sleep(1000);
    }
    await sleep(Math.max(0, state.meshPollMs - (performance.now() - t0)));
  }
}

// -------------------------------------------------------------------------------------- trajectory
async function refreshTrajectory(gen) {
  const start = state.trajectory.length;
  const t = await api('/v1/maps/' + state.mapId + '/trajectory?start=' + start);
  if (gen !== state.generation) return;
  if (t.start !== start) state.trajectory = []; // the oldest poses were dropped: start over
  for (const p of t.positions) state.trajectory.push(p);
  const pts = state.trajectory;
  if (trajLine) { scene.remove(trajLine); trajLine.geometry.dispose(); }
  if (sensorMarker) { scene.remove(sensorMarker); sensorMarker.geometry.dispose(); }
  trajLine = sensorMarker = null;
  if (pts.length) {
    const g = new THREE.BufferGeometry();
    g.setAttribute('position', new THREE.Float32BufferAttribute(pts.flat(), 3));
    trajLine = new THREE.Line(g, new THREE.LineBasicMaterial({ color: 0xff6a00 }));
    sensorMarker = new THREE.Mesh(new THREE.SphereGeometry(0.04, 12, 8),
      new THREE.MeshBasicMaterial({ color: 0xff6a00 }));
    sensorMarker.position.set(...pts[pts.length - 1]);
    trajLine.visible = sensorMarker.visible = $('show-trajectory').checked;
    scene.add(trajLine, sensorMarker);
  }
  document.body.dataset.trajectory = String(pts.length);
  requestRender();
}

// ------------------------------------------------------------------------------------------- slice
function viridis(t) {
  const x = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2), f = x - i;
  return VIRIDIS[i].map((c, k) => Math.round(c * (1 - f) + VIRIDIS[i + 1][k] * f));
}

function drawLegend(maxD) {
  const c = $('legend'), ctx = c.getContext('2d');
  for (let x = 0; x < c.width; x++) {
    const [r, g, b] = viridis(x / (c.width - 1));
    ctx.fillStyle = `rgb(${r},${g},${b})`;
    ctx.fillRect(x, 0, 1, c.height);
  }
  $('legend-max').textContent = maxD.toFixed(2) + ' m';
}

function layerBounds() {
  const b = state.status && state.status.bounds;
  if (!b) return null;
  return b.tsdf || b.occupancy || null;
}

function setupSlider() {
  const b = layerBounds(), s = $('slice-z');
  if (!b) return false;
  const vs = state.status.voxel_size_m || 0.05;
  s.min = b.min[2]; s.max = b.max[2]; s.step = vs;
  if (state.sliceZ === null) {
    const traj = state.trajectory;
    let z = traj.length ? traj[traj.length - 1][2] : (b.min[2] + b.max[2]) / 2;
    z = Math.min(Math.max(z, b.min[2]), b.max[2]);
    s.value = z;
    state.sliceZ = Number(s.value);
  }
  return true;
}

async function refreshSlice(gen) {
  if (!state.status || !state.status.layer_names.includes('esdf')) {
    $('slice-info').textContent = 'this map has no ESDF layer';
    state.sliceError = 'no esdf';
    return;
  }
  if (!setupSlider()) return;
  const z = Number($('slice-z').value);
  $('slice-z-label').textContent = 'z = ' + z.toFixed(2) + ' m';
  let s;
  try {
    s = await api('/v1/maps/' + state.mapId + '/esdf/slice?format=msgpack&z=' + z, { accept: 'application/msgpack' });
  } catch (e) {
    if (gen !== state.generation || authProblem(e)) return;
    $('slice-info').textContent = 'slice: ' + e.message;
    state.sliceError = e.message;
    return;
  }
  if (gen !== state.generation) return;
  const d = wireArray(s.distance), [h, w] = s.distance.shape, res = s.resolution_m;
  const maxD = state.status.esdf_max_distance_m || 2;
  const rgba = new Uint8Array(4 * w * h);
  let hash = 0, unknown = 0, inside = 0;
  for (let i = 0; i < w * h; i++) {
    const v = d[i];
    let c;
    if (Number.isNaN(v)) { c = UNKNOWN_RGB; unknown++; } else if (v < 0) { c = INSIDE_RGB; inside++; } else c = viridis(v / maxD);
    rgba[4 * i] = c[0]; rgba[4 * i + 1] = c[1]; rgba[4 * i + 2] = c[2];
    rgba[4 * i + 3] = Number.isNaN(v) ? UNKNOWN_ALPHA : 200;
    hash = (hash * 31 + (Number.isNaN(v) ? 7 : Math.round(v * 1000))) | 0;
  }
  const tex = new THREE.DataTexture(rgba, w, h, THREE.RGBAFormat);
  tex.colorSpace = THREE.SRGBColorSpace;
  tex.magFilter = THREE.NearestFilter;
  tex.needsUpdate = true;
  if (sliceMesh) { scene.remove(sliceMesh); sliceMesh.geometry.dispose(); sliceMesh.material.map.dispose(); }
  sliceMesh = new THREE.Mesh(new THREE.PlaneGeometry(w * res, h * res), new THREE.MeshBasicMaterial({
    map: tex, side: THREE.DoubleSide, transparent: true, depthWrite: false,
  }));
  sliceMesh.position.set(s.origin_xy[0] + w * res / 2, s.origin_xy[1] + h * res / 2, z);
  sliceMesh.visible = $('show-slice').checked;
  scene.add(sliceMesh);
  drawLegend(maxD);
  state.sliceZ = z; state.sliceHash = hash; state.sliceFetches++; state.sliceVersion = s.map_version;
  state.sliceError = null;
  state.sliceStats = { w, h, unknown, inside, origin: s.origin_xy, res };
  $('slice-info').textContent = `${w} x ${h} cells, ${(100 * unknown / (w * h)).toFixed(0)} % unknown`;
  document.body.dataset.sliceZ = z.toFixed(3);
  requestRender();
}

// ------------------------------------------------------------------------------------------ voxels
async function refreshVoxels(gen) {
  if (voxelMesh) { scene.remove(voxelMesh); voxelMesh.geometry.dispose(); voxelMesh = null; }
  $('voxel-notice').textContent = '';
  if (!$('show-voxels').checked) { requestRender(); return; }
  let r;
  try {
    r = await api('/v1/maps/' + state.mapId + '/occupied?max_voxels=' + VOXEL_CAP, { accept: 'application/msgpack' });
  } catch (e) {
    if (gen !== state.generation || authProblem(e)) return;
    $('voxel-notice').textContent = 'occupied voxels: ' + e.message;
    return;
  }
  if (gen !== state.generation) return;
  const c = wireArray(r.centers), n = c.length / 3, s = r.voxel_size_m;
  const geo = new THREE.BoxGeometry(s, s, s);
  voxelMesh = new THREE.InstancedMesh(geo, new THREE.MeshLambertMaterial({ color: 0x9ecbff }), Math.max(n, 1));
  const m = new THREE.Matrix4();
  for (let i = 0; i < n; i++) voxelMesh.setMatrixAt(i, m.makeTranslation(c[3 * i], c[3 * i + 1], c[3 * i + 2]));
  voxelMesh.count = n;
  voxelMesh.instanceMatrix.needsUpdate = true;
  scene.add(voxelMesh);
  state.voxels = { shown: n, total: r.total, capped: r.capped, version: r.map_version };
  $('voxel-notice').textContent = r.capped
    ? `Showing ${n.toLocaleString()} of ${r.total.toLocaleString()} occupied voxels (capped at ${VOXEL_CAP.toLocaleString()}).`
    : `${n.toLocaleString()} occupied voxels.`;
  document.body.dataset.voxels = String(n);
  if (!state.fitted && n > 0) { fitView(); state.fitted = true; }
  requestRender();
}

// ------------------------------------------------------------------------------------------ status
function fmtBytes(b) {
  if (b >= 1 << 30) return (b / (1 << 30)).toFixed(2) + ' GiB';
  if (b >= 1 << 20) return (b / (1 << 20)).toFixed(1) + ' MiB';
  if (b >= 1 << 10) return (b / (1 << 10)).toFixed(1) + ' KiB';
  return b + ' B';
}

let lastFrames = null;
function renderStats(st) {
  const now = performance.now();
  let fps = '';
  if (lastFrames && now > lastFrames.t) {
    fps = ((st.frames_integrated - lastFrames.n) / ((now - lastFrames.t) / 1000)).toFixed(1);
  }
  if (!lastFrames || now - lastFrames.t > 3000) lastFrames = { n: st.frames_integrated, t: now };
  const recent = state.updates.filter((u) => now - u.t < 5000);
  const rows = [
    ['map', st.name + ' (' + st.id + ')'],
    ['frames integrated', st.frames_integrated],
    ['frames/s', fps || '-'],
    ['map version', st.version],
    ['mesh version', st.mesh_version === null ? 'no TSDF' : st.mesh_version],
    ['triangles shown', store.triangles.toLocaleString()],
    ['mesh updates/s (5 s)', (recent.length / 5).toFixed(1)],
    ['ack latency', st.ack_ms === null || st.ack_ms === undefined ? '-' : st.ack_ms.toFixed(1) + ' ms'],
    ['queue', st.queue_depth],
  ];
  for (const [name, l] of Object.entries(st.layers)) {
    rows.push([name + ' voxels', l.voxels.toLocaleString()], [name + ' bytes', fmtBytes(l.bytes)]);
  }
  const body = $('stats').tBodies[0];
  body.replaceChildren(...rows.map(([k, v]) => {
    const tr = document.createElement('tr');
    for (const x of [k, v]) { const td = document.createElement('td'); td.textContent = String(x); tr.append(td); }
    return tr;
  }));
}

async function statusLoop(gen) {
  let sliceVersion = -1, voxelVersion = -1, lastSliceT = -Infinity, lastVoxelT = -Infinity, lastTraj = -1;
  while (gen === state.generation) {
    try {
      const st = await api('/v1/maps/' + state.mapId + '/status');
      if (gen !== state.generation) return;
      const first = state.status === null;
      state.status = st;
      renderStats(st);
      if (first) {
        state.hasTsdf = st.layer_names.includes('tsdf');
        if (!state.hasTsdf) {
          message('This map has no TSDF layer, so no mesh: showing its occupied voxels and the ESDF slice.');
          $('show-voxels').checked = true;
          $('show-slice').checked = true; // no mesh to hide
        } else meshLoop(gen);
        if (st.frames_integrated === 0) message('The map is empty: waiting for frames.');
      } else if (st.frames_integrated > 0 && /waiting for frames/.test($('message').textContent)) message('');
      if (st.trajectory_length !== lastTraj) { lastTraj = st.trajectory_length; await refreshTrajectory(gen); }
      const now = performance.now();
      const b = layerBounds();
      if (b) setGroundGrid(2 * Math.max(...b.min.map(Math.abs), ...b.max.map(Math.abs)));
      // the slice (when shown) and the voxels follow the map, at most every 2 s / 3 s
      if ($('show-slice').checked && st.version !== sliceVersion && now - lastSliceT > 2000) {
        lastSliceT = now; sliceVersion = st.version; refreshSlice(gen);
      }
      if ($('show-voxels').checked && st.version !== voxelVersion && now - lastVoxelT > 3000) {
        lastVoxelT = now; voxelVersion = st.version; refreshVoxels(gen);
      }
      updateColorMode();
    } catch (e) {
      if (gen !== state.generation) return;
      if (authProblem(e)) return;
      if (e instanceof ApiError && e.status >= 400 && e.status < 500) { showMapError(e); return; }
      reportError('status: ' + e.message);
    }
    await sleep(STATUS_POLL_MS);
  }
}

// -------------------------------------------------------------------------------------------- maps
function showMapError(e) {
  const text = 'Map ' + JSON.stringify(state.mapId) + ' cannot be shown: ' + e.message;
  message(text, 'error');
  overlay(text);
  state.generation++;
}

function reportError(text) {
  state.errors.push(text);
  message(text, 'error');
}

async function openMap(id) {
  state.generation++;
  const gen = state.generation;
  Object.assign(state, {
    mapId: id, status: null, meshVersion: null, meshEtag: null, meshPollMs: MESH_POLL_MS, trajectory: [], sliceZ: null, sliceHash: null,
    voxels: null, hasTsdf: true, fitted: false, updates: [], undrawn: [],
  });
  lastFrames = null;
  clearScene();
  message('');
  overlay('');
  const url = new URL(location.href);
  url.searchParams.set('map', id);
  history.replaceState(null, '', url);
  statusLoop(gen);
}

async function loadMaps() {
  let list;
  try {
    list = (await api('/v1/maps')).maps;
  } catch (e) {
    if (!authProblem(e)) { message('Cannot list maps: ' + e.message, 'error'); overlay('Cannot list maps: ' + e.message); }
    return;
  }
  state.needToken = false;
  const sel = $('map-select');
  sel.replaceChildren(...list.map((m) => {
    const o = document.createElement('option');
    o.value = m.id;
    o.textContent = (m.name || m.id) + ' - ' + m.frames_integrated + ' frames';
    return o;
  }));
  const wanted = new URL(location.href).searchParams.get('map');
  if (wanted) {
    const m = list.find((x) => x.id === wanted || x.name === wanted);
    if (m) sel.value = m.id;
    openMap(m ? m.id : wanted); // an unknown id: the service's 404 says so in the page
  } else if (list.length) {
    openMap(list[0].id);
  } else {
    message('No maps yet: create one (POST /v1/maps) and reload.');
    overlay('No maps yet.');
  }
}

// --------------------------------------------------------------------------------------- controls
function fitView() {
  const box = new THREE.Box3();
  for (const m of meshGroup.children) { m.geometry.computeBoundingBox(); box.union(m.geometry.boundingBox); }
  if (voxelMesh) { voxelMesh.computeBoundingBox(); box.union(voxelMesh.boundingBox); }
  if (box.isEmpty()) {
    const b = layerBounds();
    if (!b) return;
    box.set(new THREE.Vector3(...b.min), new THREE.Vector3(...b.max));
  }
  const c = box.getCenter(new THREE.Vector3()), r = Math.max(box.getSize(new THREE.Vector3()).length() / 2, 0.5);
  const dist = 1.5 * r / Math.sin((camera.fov * Math.PI) / 360);
  controls.target.copy(c);
  camera.position.copy(c).add(new THREE.Vector3(0.5, -0.7, 0.9).normalize().multiplyScalar(dist));
  camera.near = dist / 1000; camera.far = dist * 10;
  camera.updateProjectionMatrix();
  requestRender();
}

function screenshot() {
  renderer.render(scene, camera);
  const a = document.createElement('a');
  a.href = renderer.domElement.toDataURL('image/png');
  a.download = `mapper-${state.mapId || 'view'}-${state.meshVersion ?? 0}.png`;
  a.click();
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function wire() {
  $('map-select').addEventListener('change', (e) => openMap(e.target.value));
  $('token-save').addEventListener('click', () => {
    sessionStorage.setItem('mapperToken', $('token').value.trim());
    message('');
    overlay('');
    loadMaps();
  });
  $('token').addEventListener('keydown', (e) => { if (e.key === 'Enter') $('token-save').click(); });
  $('fit').addEventListener('click', fitView);
  $('screenshot').addEventListener('click', screenshot);
  $('color-mode').addEventListener('change', updateColorMode);
  $('show-mesh').addEventListener('change', (e) => { meshGroup.visible = e.target.checked; requestRender(); });
  $('show-trajectory').addEventListener('change', (e) => {
    for (const o of [trajLine, sensorMarker]) if (o) o.visible = e.target.checked;
    requestRender();
  });
  $('show-slice').addEventListener('change', (e) => {
    if (sliceMesh) sliceMesh.visible = e.target.checked;
    // turned on: fetch it now if there is none yet or the map changed since
    if (e.target.checked && (!sliceMesh || (state.status && state.sliceVersion !== state.status.version))) {
      refreshSlice(state.generation);
    }
    requestRender();
  });
  $('show-grid').addEventListener('change', (e) => {
    axes.visible = e.target.checked;
    if (groundGrid) groundGrid.visible = e.target.checked;
    requestRender();
  });
  $('show-voxels').addEventListener('change', () => refreshVoxels(state.generation));
  let timer = null;
  $('slice-z').addEventListener('input', () => {
    $('slice-z-label').textContent = 'z = ' + Number($('slice-z').value).toFixed(2) + ' m';
    clearTimeout(timer);
    timer = setTimeout(() => refreshSlice(state.generation), 120);
  });
}

initThree();
wire();
drawLegend(2);
loadMaps();
