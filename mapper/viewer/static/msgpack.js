// A small msgpack decoder (the subset the service sends: maps, arrays, strings, bin, ints, floats, nil,
// booleans) and the service's wire arrays ({dtype, shape, data}) as typed arrays.

export function decode(input) {
  const u8 = input instanceof Uint8Array ? input : new Uint8Array(input);
  const dv = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  const text = new TextDecoder();
  let p = 0;
  const need = (n) => {
    if (p + n > u8.length) throw new Error('msgpack: truncated message');
  };
  const str = (n) => { need(n); const s = text.decode(u8.subarray(p, p + n)); p += n; return s; };
  const bin = (n) => { need(n); const b = u8.subarray(p, p + n); p += n; return b; };
  const arr = (n) => { const a = new Array(n); for (let i = 0; i < n; i++) a[i] = read(); return a; };
  const map = (n) => {
    const o = {};
    for (let i = 0; i < n; i++) { const k = read(); o[k] = read(); }
    return o;
  };
  const u16 = () => { need(2); const v = dv.getUint16(p); p += 2; return v; };
  const u32 = () => { need(4); const v = dv.getUint32(p); p += 4; return v; };
  function read() {
    need(1);
    const t = u8[p++];
    if (t <= 0x7f) return t;
    if (t >= 0xe0) return t - 256;
    if ((t & 0xf0) === 0x80) return map(t & 0x0f);
    if ((t & 0xf0) === 0x90) return arr(t & 0x0f);
    if ((t & 0xe0) === 0xa0) return str(t & 0x1f);
    let v;
    switch (t) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: need(1); return bin(u8[p++]);
      case 0xc5: return bin(u16());
      case 0xc6: return bin(u32());
      case 0xca: need(4); v = dv.getFloat32(p); p += 4; return v;
      case 0xcb: need(8); v = dv.getFloat64(p); p += 8; return v;
      case 0xcc: need(1); return u8[p++];
      case 0xcd: return u16();
      case 0xce: return u32();
      case 0xcf: need(8); v = Number(dv.getBigUint64(p)); p += 8; return v;
      case 0xd0: need(1); v = dv.getInt8(p); p += 1; return v;
      case 0xd1: need(2); v = dv.getInt16(p); p += 2; return v;
      case 0xd2: need(4); v = dv.getInt32(p); p += 4; return v;
      case 0xd3: need(8); v = Number(dv.getBigInt64(p)); p += 8; return v;
      case 0xd9: need(1); return str(u8[p++]);
      case 0xda: return str(u16());
      case 0xdb: return str(u32());
      case 0xdc: return arr(u16());
      case 0xdd: return arr(u32());
      case 0xde: return map(u16());
      case 0xdf: return map(u32());
      default: throw new Error('msgpack: unsupported type 0x' + t.toString(16));
    }
  }
  const out = read();
  if (p !== u8.length) throw new Error('msgpack: ' + (u8.length - p) + ' trailing bytes');
  return out;
}

const TYPES = {
  float32: Float32Array, float64: Float64Array, uint16: Uint16Array, uint8: Uint8Array, int32: Int32Array,
};

// A wire array ({dtype, shape, data}) as a typed array (little-endian data; copied when unaligned).
export function wireArray(obj) {
  const C = TYPES[obj && obj.dtype];
  if (!C) throw new Error('wire array: unknown dtype ' + (obj && obj.dtype));
  const d = obj.data;
  const n = d.byteLength / C.BYTES_PER_ELEMENT;
  if (d.byteOffset % C.BYTES_PER_ELEMENT === 0) return new C(d.buffer, d.byteOffset, n);
  return new C(d.slice().buffer, 0, n);
}
