// The block mesh format of GET /v1/maps/{id}/mesh/blocks (see mapper/viewer/__init__.py) and a store that
// keeps the mesh as self-contained blocks, grouped into chunks (CHUNK^3 blocks) that are re-uploaded to
// the GPU as one geometry each when one of their blocks changes.

export const CHUNK = 8; // blocks per chunk edge (32 voxels): few draw calls, small re-uploads

export function parseBlocks(buffer) {
  const dv = new DataView(buffer);
  const magic = String.fromCharCode(dv.getUint8(0), dv.getUint8(1), dv.getUint8(2), dv.getUint8(3));
  if (magic !== 'MVB1') throw new Error('mesh: not a block mesh (magic ' + JSON.stringify(magic) + ')');
  const flags = dv.getUint32(4, true);
  const out = {
    full: (flags & 1) !== 0,
    hasColor: (flags & 2) !== 0,
    version: dv.getFloat64(8, true),
    sinceVersion: dv.getFloat64(16, true),
    voxelSize: dv.getFloat64(24, true),
  };
  const nb = dv.getUint32(32, true), nr = dv.getUint32(36, true);
  const nv = dv.getUint32(40, true), nf = dv.getUint32(44, true);
  let off = 48;
  const take = (C, n) => {
    const a = new C(buffer, off, n);
    off += a.byteLength + ((4 - (a.byteLength % 4)) % 4);
    return a;
  };
  out.blocks = take(Int32Array, nb * 3);
  out.removed = take(Int32Array, nr * 3);
  out.voff = take(Uint32Array, nb + 1);
  out.foff = take(Uint32Array, nb + 1);
  out.positions = take(Float32Array, nv * 3);
  out.normals = take(Int8Array, nv * 3);
  out.colors = out.hasColor ? take(Uint8Array, nv * 3) : null;
  out.faces = take(Uint16Array, nf * 3);
  if (off !== buffer.byteLength) throw new Error('mesh: ' + (buffer.byteLength - off) + ' unexpected bytes');
  out.numBlocks = nb;
  out.numFaces = nf;
  return out;
}

const floorDiv = (a, b) => Math.floor(a / b);

export class BlockStore {
  constructor() {
    this.blocks = new Map(); // "i,j,k" -> {chunk, positions, normals, colors, faces}
    this.chunks = new Map(); // "ci,cj,ck" -> Set of block keys
    this.dirty = new Set();
    this.triangles = 0;
    this.hasColor = false;
  }

  clear() {
    for (const c of this.chunks.keys()) this.dirty.add(c);
    this.blocks.clear();
    this.chunks.clear();
    this.triangles = 0;
  }

  _remove(key) {
    const b = this.blocks.get(key);
    if (!b) return;
    this.triangles -= b.faces.length / 3;
    this.blocks.delete(key);
    const set = this.chunks.get(b.chunk);
    set.delete(key);
    if (set.size === 0) this.chunks.delete(b.chunk);
    this.dirty.add(b.chunk);
  }

  // Apply a parsed reply: a full mesh replaces everything, a delta replaces its blocks and drops the
  // removed ones. Returns the number of blocks that changed.
  apply(m) {
    if (m.full) this.clear();
    this.hasColor = m.hasColor;
    const copy = !m.full; // deltas are small: copy so their buffers can be freed
    for (let r = 0; r < m.removed.length; r += 3) {
      this._remove(m.removed[r] + ',' + m.removed[r + 1] + ',' + m.removed[r + 2]);
    }
    const nb = m.numBlocks;
    for (let b = 0; b < nb; b++) {
      const i = m.blocks[3 * b], j = m.blocks[3 * b + 1], k = m.blocks[3 * b + 2];
      const key = i + ',' + j + ',' + k;
      this._remove(key);
      const v0 = m.voff[b], v1 = m.voff[b + 1], f0 = m.foff[b], f1 = m.foff[b + 1];
      const view = (a, s, e) => (copy ? a.slice(s, e) : a.subarray(s, e));
      const chunk = floorDiv(i, CHUNK) + ',' + floorDiv(j, CHUNK) + ',' + floorDiv(k, CHUNK);
      this.blocks.set(key, {
        chunk,
        positions: view(m.positions, 3 * v0, 3 * v1),
        normals: view(m.normals, 3 * v0, 3 * v1),
        colors: m.colors ? view(m.colors, 3 * v0, 3 * v1) : null,
        faces: view(m.faces, 3 * f0, 3 * f1),
      });
      let set = this.chunks.get(chunk);
      if (!set) this.chunks.set(chunk, (set = new Set()));
      set.add(key);
      this.dirty.add(chunk);
      this.triangles += (f1 - f0);
    }
    return nb + m.removed.length / 3;
  }

  // The arrays of one chunk (null when it has no block left): positions, normals, colours, indices.
  chunkArrays(chunk) {
    const set = this.chunks.get(chunk);
    if (!set) return null;
    let nv = 0, ni = 0;
    for (const key of set) {
      const b = this.blocks.get(key);
      nv += b.positions.length / 3;
      ni += b.faces.length;
    }
    const positions = new Float32Array(3 * nv);
    const normals = new Int8Array(3 * nv);
    const colors = this.hasColor ? new Uint8Array(3 * nv) : null;
    const index = nv < 65536 ? new Uint16Array(ni) : new Uint32Array(ni);
    let v = 0, f = 0;
    for (const key of set) {
      const b = this.blocks.get(key);
      positions.set(b.positions, 3 * v);
      normals.set(b.normals, 3 * v);
      if (colors && b.colors) colors.set(b.colors, 3 * v);
      const faces = b.faces;
      for (let t = 0; t < faces.length; t++) index[f + t] = faces[t] + v;
      v += b.positions.length / 3;
      f += faces.length;
    }
    return { positions, normals, colors, index };
  }
}
